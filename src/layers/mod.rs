//! Building blocks shared by the model families.

pub mod attention;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rotary;
