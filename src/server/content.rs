//! Content given as a list of typed items (OpenAI content parts, Anthropic content blocks):
//! text, and images for vision-language models.

use serde_json::Value;

use super::errors::ApiError;
use super::images::ImageRef;
use crate::tokenizer::ContentPart;

enum Item<'a> {
    Text(&'a str),
    Image(ImageRef),
}

/// Reads item `j` of the list at `path`: a text item's type is `text_type`. Images are
/// accepted when `image` names their item type and how to read one.
fn item<'a>(
    item: &'a Value,
    path: &str,
    j: usize,
    (noun, text_type): (&str, &str),
    image: Option<(&str, ImageReader)>,
) -> Result<Item<'a>, ApiError> {
    let at = format!("{path}[{j}]");
    match item.get("type").and_then(Value::as_str) {
        Some(t) if t == text_type => match item.get("text") {
            Some(Value::String(t)) => Ok(Item::Text(t.as_str())),
            _ => Err(ApiError::invalid_param(format!("{at}.text"), format!("`{at}.text` must be a string"))),
        },
        Some(t) if image.is_some_and(|(kind, _)| kind == t) => Ok(Item::Image(image.expect("checked").1(item, &at)?)),
        Some(other) => {
            let accepted = match image {
                Some((kind, _)) => format!("{text_type} and {kind} {noun}s"),
                None => format!("{text_type} {noun}s only"),
            };
            Err(ApiError::invalid_param(
                format!("{at}.type"),
                format!("unsupported content {noun} type `{other}` in `{at}`: this server accepts {accepted}"),
            ))
        }
        None => {
            Err(ApiError::invalid_param(format!("{at}.type"), format!("`{at}` must be an object with a string `type`")))
        }
    }
}

/// Reads one image item at a JSON path.
pub type ImageReader = fn(&Value, &str) -> Result<ImageRef, ApiError>;

/// The texts of `[{"type": "text", "text": ...}, ...]` at `path`, in order. `noun` names an
/// item in errors ("part" for OpenAI, "block" for Anthropic).
pub fn text_items<'a>(items: &'a [Value], path: &str, noun: &str) -> Result<Vec<&'a str>, ApiError> {
    typed_text_items(items, path, noun, "text")
}

/// [`text_items`] whose text items have the type `text_type` (the Responses API's
/// `input_text` and `output_text`).
pub fn typed_text_items<'a>(
    items: &'a [Value],
    path: &str,
    noun: &str,
    text_type: &str,
) -> Result<Vec<&'a str>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(j, it)| match item(it, path, j, (noun, text_type), None)? {
            Item::Text(t) => Ok(t),
            Item::Image(_) => unreachable!("images are not accepted here"),
        })
        .collect()
}

/// Text and image items in order: each image becomes an image part (the chat template writes
/// its placeholder) and a reference to load. `image_type` is an image item's type
/// ("image_url" for OpenAI, "image" for Anthropic).
pub fn mixed_items(
    items: &[Value],
    path: &str,
    noun: &str,
    image_type: &str,
    read: ImageReader,
) -> Result<(Vec<ContentPart>, Vec<ImageRef>), ApiError> {
    typed_mixed_items(items, path, (noun, "text"), image_type, read)
}

/// [`mixed_items`] whose text items have the type `text_type` (`(noun, text_type)`).
pub fn typed_mixed_items(
    items: &[Value],
    path: &str,
    (noun, text_type): (&str, &str),
    image_type: &str,
    read: ImageReader,
) -> Result<(Vec<ContentPart>, Vec<ImageRef>), ApiError> {
    let mut parts = Vec::with_capacity(items.len());
    let mut images = Vec::new();
    for (j, it) in items.iter().enumerate() {
        match item(it, path, j, (noun, text_type), Some((image_type, read)))? {
            Item::Text(t) => parts.push(ContentPart::text(t)),
            Item::Image(r) => {
                images.push(r);
                parts.push(ContentPart::image());
            }
        }
    }
    Ok((parts, images))
}
