//! An activation function on its own, op by op with candle (`gated_act` fuses the gated
//! ones with their product).

use candle_core::{Result, Tensor};

use crate::config::Activation;

pub fn apply(act: Activation, x: &Tensor) -> Result<Tensor> {
    match act {
        Activation::Silu => candle_nn::ops::silu(x),
        Activation::GeluTanh => x.gelu(),
        Activation::Gelu => x.gelu_erf(),
        Activation::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
    }
}
