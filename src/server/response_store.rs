//! The Responses API's stored responses (`store: true`): what `GET /v1/responses/{id}`
//! returns and `previous_response_id` continues. In memory, at most `capacity` of them; the
//! least recently used goes first when one more arrives (a lookup counts as a use), so a
//! server that runs for weeks holds a bounded number.
//!
//! A stored response keeps its own turn (the input it was given and its output, as chat
//! messages) and a reference to the response it continued: a conversation of many turns is
//! one chain, never copied per turn, and a turn whose predecessor was evicted from the index
//! still has its whole history.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::images::ImageRef;
use crate::tokenizer::ChatMessage;

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    /// The Response object, as the create call returned it.
    pub response: Value,
    /// The response `previous_response_id` named, if any.
    pub parent: Option<Arc<Stored>>,
    /// This turn: its input messages (instructions excluded: OpenAI does not carry them
    /// over) and its output as the assistant's messages.
    pub messages: Vec<ChatMessage>,
    /// The images of `messages`' image parts, in order.
    pub images: Vec<ImageRef>,
}

impl Stored {
    /// The whole conversation up to and including this response, oldest turn first.
    pub fn history(self: &Arc<Self>) -> (Vec<ChatMessage>, Vec<ImageRef>) {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(s) = at {
            chain.push(s);
            at = s.parent.as_ref();
        }
        let mut messages = Vec::new();
        let mut images = Vec::new();
        for s in chain.into_iter().rev() {
            messages.extend(s.messages.iter().cloned());
            images.extend(s.images.iter().cloned());
        }
        (messages, images)
    }
}

/// A response to store once it is done: where it continues from and its input.
pub struct Turn {
    pub store: Arc<ResponseStore>,
    pub parent: Option<Arc<Stored>>,
    pub messages: Vec<ChatMessage>,
    pub images: Vec<ImageRef>,
}

impl Turn {
    /// Stores the finished `response` (its `output` items become the assistant's messages,
    /// read as input items are: what a client would send back is what the store keeps).
    pub fn keep(mut self, response: Value) {
        let Some(id) = response.get("id").and_then(Value::as_str).map(str::to_string) else { return };
        let output = response.get("output").cloned().unwrap_or(Value::Array(Vec::new()));
        match super::responses_request::input_messages(&output, "output") {
            Ok((messages, images)) => {
                self.messages.extend(messages);
                self.images.extend(images);
            }
            Err(e) => {
                // iris's own output always reads back; if it did not, storing a turn without
                // its answer would continue a different conversation.
                tracing::warn!("response {id} not stored: its output does not read back as input: {e}");
                return;
            }
        }
        let stored = Stored { response, parent: self.parent, messages: self.messages, images: self.images };
        self.store.insert(id, Arc::new(stored));
    }
}

#[derive(Default)]
struct Index {
    /// Bumped on every insert and lookup: an entry's last use.
    clock: u64,
    entries: HashMap<String, (u64, Arc<Stored>)>,
    /// Last use -> id, oldest first.
    by_use: BTreeMap<u64, String>,
}

impl Index {
    fn touch(&mut self, id: &str) -> Option<Arc<Stored>> {
        self.clock += 1;
        let clock = self.clock;
        let (used, stored) = self.entries.get_mut(id)?;
        self.by_use.remove(used);
        *used = clock;
        self.by_use.insert(clock, id.to_string());
        Some(stored.clone())
    }
}

pub struct ResponseStore {
    capacity: usize,
    index: Mutex<Index>,
}

impl ResponseStore {
    /// A store of at most `capacity` responses (0: nothing is stored).
    pub fn new(capacity: usize) -> Self {
        ResponseStore { capacity, index: Mutex::new(Index::default()) }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        // The index stays consistent between statements, so a panic elsewhere while it was
        // held leaves nothing half-done: keep serving.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `stored` under `id`, evicting the least recently used beyond the capacity.
    pub fn insert(&self, id: String, stored: Arc<Stored>) {
        if self.capacity == 0 {
            return;
        }
        let mut ix = self.lock();
        ix.clock += 1;
        let clock = ix.clock;
        if let Some((old, _)) = ix.entries.insert(id.clone(), (clock, stored)) {
            ix.by_use.remove(&old);
        }
        ix.by_use.insert(clock, id);
        while ix.entries.len() > self.capacity {
            let Some((_, oldest)) = ix.by_use.pop_first() else { break };
            ix.entries.remove(&oldest);
        }
    }

    /// The response stored under `id` (a use: it becomes the most recent).
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.lock().touch(id)
    }

    /// Removes `id`; false when it was not stored. Responses that continued it keep their
    /// history.
    pub fn remove(&self, id: &str) -> bool {
        let mut ix = self.lock();
        match ix.entries.remove(id) {
            Some((used, _)) => {
                ix.by_use.remove(&used);
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn turn(text: &str, parent: Option<Arc<Stored>>) -> Arc<Stored> {
        Arc::new(Stored {
            response: json!({ "text": text }),
            parent,
            messages: vec![ChatMessage::text("user", text)],
            images: Vec::new(),
        })
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let s = ResponseStore::new(2);
        s.insert("a".into(), turn("a", None));
        s.insert("b".into(), turn("b", None));
        assert!(s.get("a").is_some()); // a is now more recent than b
        s.insert("c".into(), turn("c", None));
        assert_eq!(s.len(), 2);
        assert!(s.get("b").is_none(), "b was the least recently used");
        assert!(s.get("a").is_some() && s.get("c").is_some());
        assert!(s.remove("a"));
        assert!(!s.remove("a"));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn a_chain_outlives_its_evicted_turns() {
        let s = ResponseStore::new(1);
        let first = turn("one", None);
        s.insert("r1".into(), first.clone());
        let second = turn("two", Some(first));
        s.insert("r2".into(), second);
        assert!(s.get("r1").is_none());
        let (messages, _) = s.get("r2").expect("stored").history();
        assert_eq!(messages, [ChatMessage::text("user", "one"), ChatMessage::text("user", "two")]);
    }

    #[test]
    fn capacity_zero_stores_nothing() {
        let s = ResponseStore::new(0);
        s.insert("a".into(), turn("a", None));
        assert!(s.is_empty());
        assert!(s.get("a").is_none());
    }
}
