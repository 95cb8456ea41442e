//! Bytes per weight by storage format, for `iris inspect`: what a step reads.

use std::collections::BTreeMap;

use super::mlx::{MlxQuantization, ModuleQuant};
use super::safetensors::SafetensorsDir;
use super::GgufFile;

/// The tensors of one storage format.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatShare {
    pub format: String,
    pub tensors: usize,
    pub weights: u64,
    pub bytes: u64,
}

impl FormatShare {
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.bytes as f64 / self.weights.max(1) as f64
    }
}

fn add(shares: &mut BTreeMap<String, FormatShare>, format: String, weights: u64, bytes: u64) {
    let s = shares.entry(format.clone()).or_insert(FormatShare { format, tensors: 0, weights: 0, bytes: 0 });
    s.tensors += 1;
    s.weights += weights;
    s.bytes += bytes;
}

/// Largest share first.
fn sorted(shares: BTreeMap<String, FormatShare>) -> Vec<FormatShare> {
    let mut v: Vec<FormatShare> = shares.into_values().collect();
    v.sort_by_key(|s| std::cmp::Reverse(s.bytes));
    v
}

pub fn of_gguf(g: &GgufFile) -> Vec<FormatShare> {
    let mut shares = BTreeMap::new();
    for info in g.content().tensor_infos.values() {
        let dt = info.ggml_dtype;
        let n = info.shape.elem_count() as u64;
        add(&mut shares, format!("{dt:?}"), n, n / dt.block_size() as u64 * dt.type_size() as u64);
    }
    sorted(shares)
}

/// An MLX module's codes, scales and biases count as one matrix of its format (its bits read
/// off the config, or off the shapes when the config has no block); float tensors by dtype.
pub fn of_safetensors(st: &SafetensorsDir, mlx: Option<&MlxQuantization>) -> Vec<FormatShare> {
    let tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>)> = st.views().into_iter().collect();
    let mut shares = BTreeMap::new();
    for (name, (dtype, shape)) in &tensors {
        let elems: u64 = shape.iter().product::<usize>() as u64;
        let bytes = elems * (dtype.bitsize() / 8) as u64;
        let module = name.strip_suffix(".scales").or_else(|| name.strip_suffix(".biases"));
        // Counted with its codes, when the config says the module's bits (else all three
        // tensors are counted as what they are stored as).
        if mlx.is_some() && module.is_some_and(|m| tensors.contains_key(&format!("{m}.weight"))) {
            continue;
        }
        let quantized = name.strip_suffix(".weight").and_then(|m| {
            let (sdt, sshape) = tensors.get(&format!("{m}.scales"))?;
            let groups = *sshape.last()? as u64;
            let words = *shape.last()? as u64;
            let rows = elems / words.max(1);
            let bits = match mlx.map(|q| q.module(m)) {
                Some(ModuleQuant::Affine(p)) => u64::from(p.bits),
                _ => return None,
            };
            let cols = words * 32 / bits;
            let side = 2 * rows * groups * (sdt.bitsize() / 8) as u64;
            Some((format!("MLX affine {bits}-bit g{}", cols / groups.max(1)), rows * cols, bytes + side))
        });
        match quantized {
            Some((format, weights, bytes)) => add(&mut shares, format, weights, bytes),
            None => add(&mut shares, format!("{dtype:?}").to_lowercase(), elems, bytes),
        }
    }
    sorted(shares)
}
