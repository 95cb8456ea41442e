//! Building blocks shared by the model families.

pub mod attention;
pub mod centroid_head;
pub mod embedding;
pub mod ffn;
pub mod gated_deltanet;
pub mod grid_sample;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod mtp;
pub mod norm;
pub mod per_layer_embedding;
pub mod rotary;
pub mod vision;
