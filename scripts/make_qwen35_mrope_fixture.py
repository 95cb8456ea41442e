"""Qwen3.5's interleaved M-RoPE as transformers 5.24 computes it, for iris's unit tests.

For a prompt of text, two images and text (token type ids as the processor marks them), writes
tests/fixtures/qwen35_mrope.json: the three-axis positions from `Qwen3_5Model.get_rope_index`
and the cos/sin of `Qwen3_5TextRotaryEmbedding` at them (the first half of the rotary dims; the
second half repeats it), with a real Qwen3.5 rotary shape (head_dim 256, partial rotary 0.25,
`mrope_section` [11, 11, 10], theta 1e7). src/layers/rotary.rs and src/models/mrope.rs check
theirs against it.

Run: ~/.cache/iris/torch-venv/bin/python scripts/make_qwen35_mrope_fixture.py
"""

import json
import pathlib
import types

import torch
import transformers
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/qwen35_mrope.json"
IMAGE = 9
MERGE = 2
GRIDS = [[1, 4, 6], [1, 6, 2]]


def main():
    cfg = Qwen3_5TextConfig(head_dim=256, hidden_size=512, num_attention_heads=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25,
                                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    tokens = [1, 2, 3] + [IMAGE] * 6 + [4] + [IMAGE] * 3 + [5, 6]
    types_ = [1 if t == IMAGE else 0 for t in tokens]
    # get_rope_index reads only the merge size from its model.
    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=MERGE)))
    fake.get_vision_position_ids = types.MethodType(Qwen3_5Model.get_vision_position_ids, fake)
    pos, delta = Qwen3_5Model.get_rope_index(
        fake, torch.tensor([tokens]), torch.tensor([types_]), image_grid_thw=torch.tensor(GRIDS))
    rot = Qwen3_5TextRotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, pos)
    half = cos.shape[-1] // 2
    assert torch.equal(cos[..., :half], cos[..., half:])
    fixture = {
        "transformers": transformers.__version__,
        "rope_theta": 1e7, "head_dim": 256, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "tokens": tokens, "image_token": IMAGE, "grids": GRIDS, "merge": MERGE,
        "positions": pos[:, 0].T.tolist(), "delta": int(delta[0, 0]),
        "cos": cos[0, :, :half].tolist(), "sin": sin[0, :, :half].tolist(),
    }
    OUT.write_text(json.dumps(fixture) + "\n")
    print(pos[:, 0].T.tolist(), int(delta[0, 0]))


if __name__ == "__main__":
    main()
