//! Settings read from the environment once, to compare code paths on one machine (the A/B
//! runs of `scripts/gpu-variants.sh`, docs/benchmarks.md). Not configuration: the defaults are
//! what serves.

/// Whether a path is taken: yes, unless the environment sets `$name=0`.
macro_rules! switched_on {
    ($name:literal) => {{
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var($name).map_or(true, |v| v != "0"))
    }};
}

/// A number the environment may set (`$name=N`, parsed as `$ty`), else `$default`.
macro_rules! tuned {
    ($name:literal, $ty:ty, $default:expr) => {{
        static VALUE: std::sync::OnceLock<$ty> = std::sync::OnceLock::new();
        *VALUE.get_or_init(|| std::env::var($name).ok().and_then(|v| v.parse::<$ty>().ok()).unwrap_or($default))
    }};
}

#[allow(unused_imports)] // only CUDA builds use some of them
pub(crate) use {switched_on, tuned};
