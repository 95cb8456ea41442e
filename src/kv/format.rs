//! What a KV pool stores per token: a float type, or TurboQuant codes with their settings,
//! and what that costs in bytes.

use std::fmt;
use std::str::FromStr;

use candle_core::DType;

use crate::ops::turboquant::pack::packed_len;

/// Element type of a dense KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
    F16,
}

impl KvDtype {
    pub fn dtype(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::Bf16 => DType::BF16,
            KvDtype::F16 => DType::F16,
        }
    }

    pub fn from_dtype(d: DType) -> Option<Self> {
        match d {
            DType::F32 => Some(KvDtype::F32),
            DType::BF16 => Some(KvDtype::Bf16),
            DType::F16 => Some(KvDtype::F16),
            _ => None,
        }
    }

    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvFormatError {
    #[error("unknown KV cache dtype `{0}` (use auto, f32, bf16, f16, or tq-kXvY with key bits X and value bits Y in 2..=4, e.g. tq-k3v4)")]
    UnknownDtype(String),
    #[error("`{0}` is not a layer index (use e.g. 0,-1 for the first and the last layer)")]
    BadLayer(String),
    #[error("layer {index} does not exist: the model has {layers} layers")]
    NoSuchLayer { index: i64, layers: usize },
    #[error("{0} only applies to a TurboQuant --kv-cache-dtype (tq-kXvY)")]
    NeedsTurboQuant(&'static str),
}

/// Bits per coordinate of a TurboQuant cache's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TqBits {
    pub key: u8,
    pub value: u8,
}

impl TqBits {
    pub const SUPPORTED: std::ops::RangeInclusive<u8> = 2..=4;
}

impl fmt::Display for TqBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tq-k{}v{}", self.key, self.value)
    }
}

/// `--kv-cache-dtype`: the model's dtype, a float type, or TurboQuant codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheDtype {
    Auto,
    Float(KvDtype),
    TurboQuant(TqBits),
}

impl FromStr for KvCacheDtype {
    type Err = KvFormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || KvFormatError::UnknownDtype(s.to_string());
        Ok(match s {
            "auto" => KvCacheDtype::Auto,
            "f32" | "float32" => KvCacheDtype::Float(KvDtype::F32),
            "bf16" | "bfloat16" => KvCacheDtype::Float(KvDtype::Bf16),
            "f16" | "float16" | "half" => KvCacheDtype::Float(KvDtype::F16),
            _ => {
                let rest = s.strip_prefix("tq-k").ok_or_else(bad)?;
                let (k, v) = rest.split_once('v').ok_or_else(bad)?;
                let bits = |x: &str| x.parse::<u8>().ok().filter(|b| TqBits::SUPPORTED.contains(b));
                KvCacheDtype::TurboQuant(TqBits { key: bits(k).ok_or_else(bad)?, value: bits(v).ok_or_else(bad)? })
            }
        })
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvCacheDtype::Auto => f.write_str("auto"),
            KvCacheDtype::Float(d) => d.fmt(f),
            KvCacheDtype::TurboQuant(b) => b.fmt(f),
        }
    }
}

/// Layer indices as given on the command line ("0,-1"): negative ones count from the end.
pub fn parse_layer_list(s: &str) -> Result<Vec<i64>, KvFormatError> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<i64>().map_err(|_| KvFormatError::BadLayer(x.to_string())))
        .collect()
}

/// Resolves command-line layer indices against a model's layer count; sorted, deduplicated.
pub fn resolve_layers(given: &[i64], layers: usize) -> Result<Vec<usize>, KvFormatError> {
    let mut out = given
        .iter()
        .map(|&i| {
            let r = if i < 0 { layers as i64 + i } else { i };
            if (0..layers as i64).contains(&r) {
                Ok(r as usize)
            } else {
                Err(KvFormatError::NoSuchLayer { index: i, layers })
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The layout of a TurboQuant pool.
#[derive(Debug, Clone, PartialEq)]
pub struct TqSpec {
    pub bits: TqBits,
    /// Layers that keep dense float storage (sorted).
    pub skip_layers: Vec<usize>,
    /// A query at position p reads positions p - float_window < j <= p unquantized (0: none).
    pub float_window: usize,
    /// Sequences that can hold a float window at once (one ring each; the engine's
    /// max-num-seqs). Unused when `float_window` is 0.
    pub window_rings: usize,
    /// Per layer, per kv head and channel, the factor keys are multiplied by before they are
    /// quantized (queries are divided by it): `kv::calibration`. Empty: none.
    pub key_scales: Vec<Vec<f32>>,
}

impl TqSpec {
    pub fn new(bits: TqBits) -> Self {
        TqSpec { bits, skip_layers: Vec::new(), float_window: 0, window_rings: 0, key_scales: Vec::new() }
    }

    pub fn quantizes(&self, layer: usize) -> bool {
        self.skip_layers.binary_search(&layer).is_err()
    }

    /// Bytes of one stored key row (codes + f32 norm) and one value row.
    pub fn row_bytes(&self, head_dim: usize) -> (usize, usize) {
        (packed_len(head_dim, self.bits.key) + 4, packed_len(head_dim, self.bits.value) + 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_dtype_and_rejects_the_rest() {
        assert_eq!("auto".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Auto));
        assert_eq!("bf16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Float(KvDtype::Bf16)));
        assert_eq!("f16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Float(KvDtype::F16)));
        assert_eq!("f32".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Float(KvDtype::F32)));
        for k in 2..=4 {
            for v in 2..=4 {
                let s = format!("tq-k{k}v{v}");
                let d: KvCacheDtype = s.parse().unwrap();
                assert_eq!(d, KvCacheDtype::TurboQuant(TqBits { key: k, value: v }));
                assert_eq!(d.to_string(), s);
            }
        }
        for bad in ["tq-k1v4", "tq-k5v4", "tq-k3", "tq-k3v", "tq-kv4", "k3v4", "tq-k3v4x", "int8", ""] {
            assert!(bad.parse::<KvCacheDtype>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn layer_lists_count_from_the_end() {
        assert_eq!(resolve_layers(&parse_layer_list("0,-1, 3,0").unwrap(), 30).unwrap(), vec![0, 3, 29]);
        assert!(parse_layer_list("0,last").is_err());
        assert!(resolve_layers(&[30], 30).is_err());
        assert!(resolve_layers(&[-31], 30).is_err());
    }
}
