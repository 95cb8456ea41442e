//! Tokenization: tokenizer.json or GGUF metadata, chat templates.
