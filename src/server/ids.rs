//! Response and tool-call ids: a prefix (`chatcmpl-`, `msg_`, `call_`, `toolu_`) and 24 random
//! hex digits. A file of its own because the reply parsers and the request handling both use it.

pub fn random_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}
