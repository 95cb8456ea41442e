//! Key scales for a TurboQuant cache (`kv::calibration`): a fixed English text run once
//! through the model, its queries' and keys' moments recorded per layer.

use candle_core::{Device, Result};

use crate::batch::Batch;
use crate::batch::SeqSlice;
use crate::kv::KvCache;
use crate::models::TextModel;
use crate::tokenizer::TextTokenizer;

/// Most tokens of the text used.
const MAX_TOKENS: usize = 512;

/// Plain prose on everyday subjects, written for this purpose.
const TEXT: &str = "The river runs past the old mill and under three stone bridges before it \
reaches the harbour. In spring the water rises quickly, and the people who live along the bank \
move their boats to higher ground. Most of them have done this every year for as long as they \
can remember, so nobody is surprised when the first warm week arrives and the snow in the hills \
begins to melt.\n\nAt the school on the hill, the children are learning how a river carries \
sand and small stones from one place to another. Their teacher asks them to measure how fast a \
leaf travels between two marks on the wall of the canal, and to write down the time it takes. \
Some of the results are strange: one leaf gets caught in a corner and never arrives at all. \
The class decides that a good experiment should be repeated several times, and that the \
average is more useful than any single number.\n\nMeanwhile, the market in the square is busy. \
A woman sells bread that she baked before sunrise; a man next to her repairs bicycles and \
radios, and says he can fix almost anything that has wheels or wires. Tourists ask for \
directions to the museum, which holds paintings of the town from two hundred years ago, when \
the mill still ground flour for the whole valley. Today the mill is a library, and on quiet \
afternoons you can hear the water turning the wheel that no longer turns anything else.\n\n\
In the evening the temperature falls, the lights come on along the harbour wall, and the \
fishing boats return with their catch. Questions about the weather, prices, and the news from \
the capital are discussed in the cafe until late. What will the summer bring? Nobody knows, \
but everyone has an opinion, and most of the opinions are expressed with great confidence.";

/// Per layer, the key scales `[kv_heads * head_dim]` measured on the built-in text.
pub fn key_scales(model: &dyn TextModel, tokenizer: &TextTokenizer, device: &Device) -> Result<Vec<Vec<f32>>> {
    let cfg = model.config();
    let mut tokens = tokenizer.encode(TEXT, true).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    tokens.truncate(MAX_TOKENS);
    if tokens.is_empty() {
        candle_core::bail!("the calibration text has no tokens");
    }
    let bs = 16;
    let kv = KvCache::calibration(cfg, bs, tokens.len(), device)?;
    let seq = SeqSlice {
        q_start: 0,
        q_len: tokens.len(),
        context_len: tokens.len(),
        block_table: (0..tokens.len().div_ceil(bs) as u32).collect(),
    };
    let mut batch = Batch::from_tokens(device, bs, vec![seq], &tokens)?;
    // A hybrid model's recurrent layers hold one state, for this sequence.
    batch.attn.set_state_slots(vec![0])?;
    model.forward(&batch, &kv, None)?;
    Ok(kv.key_scales(cfg))
}
