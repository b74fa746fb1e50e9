"""`fastgen::latent_attention` (MLA over the paged latent cache) against a float64 MLA oracle.

The oracle does MLA the way the model defines it, without the absorption: it up-projects every
cached latent into each head's key (`[W_UK c, k_rope]`) and value (`W_UV c`), attends causally in
float64 and returns the values' weighted sums. The op side absorbs `W_UK` into the query, attends
over the cached vectors and applies `W_UV` to the latent output, as `models/deepseek_v3.py` does. The
latent cache starts NaN, blocks are shuffled and block tables hold arbitrary ids in unused columns,
so a read of an unwritten slot or a write to a wrong one shows. The Triton path runs under the
interpreter on small shapes.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are defined (lazily, on first launch)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import fastgen.ops  # noqa: E402  (registers the fastgen:: ops)
from fastgen.models.config import ModelConfig  # noqa: E402
from fastgen.ops import AttentionMetadata, allocate_kv_cache, latent_attention  # noqa: E402

HEADS, RANK, ROPE, NOPE, VDIM = 4, 32, 16, 24, 20
WIDTH = RANK + ROPE
TORCH_OP = torch.ops.fastgen.latent_attention_torch
TRITON_OP = torch.ops.fastgen.latent_attention_triton


def mla_oracle(q_nope, q_rope, latents: list[torch.Tensor], w_uk, w_uv, scale: float) -> torch.Tensor:
    """float64 `[Q, H, VDIM]`: the last Q positions of one sequence (queries `[Q, H, NOPE]`/`[Q, H, ROPE]`)
    over its `latents` (one `[c, k_rope]` per position), each head with its own keys `[W_UK c, k_rope]`
    and values `W_UV c` (`w_uk` `[H, NOPE, RANK]`, `w_uv` `[H, VDIM, RANK]`)."""
    num_q, length = q_nope.shape[0], len(latents)
    out = torch.zeros(num_q, HEADS, VDIM, dtype=torch.float64)
    for row in range(num_q):
        i = length - num_q + row
        for h in range(HEADS):
            scores, values = [], []
            for j in range(i + 1):
                c, k_rope = latents[j][:RANK].double(), latents[j][RANK:].double()
                key = torch.cat((w_uk[h].double() @ c, k_rope))
                query = torch.cat((q_nope[row, h].double(), q_rope[row, h].double()))
                scores.append(float(query @ key) * scale)
                values.append(w_uv[h].double() @ c)
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[row, h] = sum(w / total * v for w, v in zip(weights, values))
    return out


class _Mla:
    """A NaN-poisoned latent cache with shuffled blocks; each `step` checks one op call against the oracle."""

    def __init__(self, block_size: int = 4, num_blocks: int = 48, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype = block_size, dtype
        self.cache = allocate_kv_cache(num_blocks, block_size, 1, WIDTH, dtype, "cpu").fill_(float("nan"))
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.w_uk = torch.randn(HEADS, NOPE, RANK, generator=self.gen) / RANK**0.5
        self.w_uv = torch.randn(HEADS, VDIM, RANK, generator=self.gen) / RANK**0.5
        self.scale = (NOPE + ROPE) ** -0.5

    def _randn(self, *shape: int) -> torch.Tensor:
        return (2 * torch.randn(*shape, generator=self.gen)).to(self.dtype)

    def step(self, seqs: list[dict], news: list[int], op=TORCH_OP, pad_tokens: int = 0, pad_rows: int = 0,
             metadata_call: bool = False) -> None:
        """One op call: sequence `seqs[i]` (`{"blocks", "latents"}`) gains `news[i]` tokens."""
        total = sum(news) + pad_tokens
        q_nope, q_rope = self._randn(total, HEADS, NOPE), self._randn(total, HEADS, ROPE)
        latent = self._randn(total, 1, WIDTH)
        slots, lens, starts = [], [], [0]
        for seq, n in zip(seqs, news):
            for pos in range(len(seq["latents"]), len(seq["latents"]) + n):
                if pos // self.block_size == len(seq["blocks"]):
                    seq["blocks"].append(self.free.pop())
                slots.append(seq["blocks"][pos // self.block_size] * self.block_size + pos % self.block_size)
            seq["latents"] += list(latent[starts[-1]:starts[-1] + n, 0])
            lens.append(len(seq["latents"]))
            starts.append(starts[-1] + n)
        width = max(len(s["blocks"]) for s in seqs) + 1
        tables = torch.randint(0, self.cache.shape[0], (len(seqs) + pad_rows, width), generator=self.gen,
                               dtype=torch.int32)
        for row, seq in enumerate(seqs):
            tables[row, :len(seq["blocks"])] = torch.tensor(seq["blocks"], dtype=torch.int32)
        md = AttentionMetadata(torch.tensor(slots + [-1] * pad_tokens), tables,
                               torch.tensor(lens + [0] * pad_rows, dtype=torch.int32),
                               torch.tensor(starts + [starts[-1]] * pad_rows, dtype=torch.int32))
        # The absorbed query: W_UK^T q_nope per head, then the rotary part.
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope.float(), self.w_uk).to(self.dtype), q_rope), dim=-1)
        if metadata_call:
            out = latent_attention(query, latent, (self.cache,), md, self.scale)
        else:
            out = op(query, latent, self.cache, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc,
                     self.scale)
        assert out.shape == (total, HEADS, WIDTH)
        assert torch.count_nonzero(out[sum(news):]) == 0, "padded tokens must give zeros"
        values = torch.einsum("thr,hvr->thv", out[..., :RANK].float(), self.w_uv)
        tol = dict(rtol=2e-5, atol=2e-5) if self.dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
        for seq, n, start in zip(seqs, news, starts):
            expected = mla_oracle(q_nope[start:start + n], q_rope[start:start + n], seq["latents"], self.w_uk,
                                  self.w_uv, self.scale)
            torch.testing.assert_close(values[start:start + n].double(), expected, **tol)
            for pos, vec in enumerate(seq["latents"]):  # every latent at its slot, bit for bit
                block = seq["blocks"][pos // self.block_size]
                assert torch.equal(self.cache[block, pos % self.block_size, 0], vec)
        written = (~self.cache.isnan()).all(-1).sum()
        assert int(written) == sum(len(s["latents"]) for s in seqs), "a write went to a wrong slot"


def _new(n: int) -> list[dict]:
    return [{"blocks": [], "latents": []} for _ in range(n)]


@pytest.mark.parametrize("op", [TORCH_OP, TRITON_OP], ids=["torch", "triton"])
def test_mixed_step_matches_mla_oracle(op):
    """Context first (a prefill step), then decodes (more than three: merged block by block), chunks over
    context, and first chunks in one call, with padding."""
    h = _Mla(seed=1)
    seqs = _new(7)
    contexts = [5, 9, 0, 13, 4, 6, 0]
    h.step([s for s, c in zip(seqs, contexts) if c], [c for c in contexts if c], op=op)
    h.step(seqs, [1, 3, 7, 1, 1, 1, 1], op=op, pad_tokens=2, pad_rows=1)
    h.step(seqs, [1] * 7, op=op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_few_decode_rows_and_the_model_entry_point(dtype):
    """Up to three decode rows (attended one by one) through `fastgen.ops.latent_attention`, eager."""
    h = _Mla(seed=2, dtype=dtype)
    seqs = _new(2)
    h.step(seqs, [3, 11], metadata_call=True)
    for _ in range(3):
        h.step(seqs, [1, 1], metadata_call=True, pad_tokens=1)


def test_bad_shapes_are_named():
    cache = torch.zeros(4, 4, 1, WIDTH)
    args = (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="latent"):
        TORCH_OP(torch.zeros(1, HEADS, WIDTH), torch.zeros(1, 2, WIDTH), cache, *args)
    with pytest.raises(ValueError, match="latent cache"):
        TORCH_OP(torch.zeros(1, HEADS, WIDTH), torch.zeros(1, 1, WIDTH), torch.zeros(4, 4, 2, WIDTH), *args)


def test_opcheck_and_compile():
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(8, 4, 1, WIDTH)
    args = (torch.randn(7, HEADS, WIDTH, generator=gen), torch.randn(7, 1, WIDTH, generator=gen), cache,
            torch.tensor([8, 9, 10, 20, 21, 22, -1]), torch.tensor([[2, 7], [5, 7], [0, 0]], dtype=torch.int32),
            torch.tensor([3, 3, 0], dtype=torch.int32), torch.tensor([0, 3, 6, 6], dtype=torch.int32), 0.25)
    result = torch.library.opcheck(torch.ops.fastgen.latent_attention.default, args)
    assert set(result.values()) == {"SUCCESS"}, result
    eager_cache = cache.clone()
    expected = torch.ops.fastgen.latent_attention(args[0], args[1], eager_cache, *args[3:]) * 2
    compiled = torch.compile(lambda q, l, c, *rest: torch.ops.fastgen.latent_attention(q, l, c, *rest) * 2,
                             fullgraph=True, dynamic=False)
    compiled_cache = cache.clone()
    torch.testing.assert_close(compiled(args[0], args[1], compiled_cache, *args[3:]), expected)
    torch.testing.assert_close(compiled_cache, eager_cache, rtol=0, atol=0)


def test_config_sizes_the_latent_cache():
    """An MLA config caches kv_lora_rank + qk_rope_head_dim values per token and layer, once on every
    rank; others K and V per KV head."""
    raw = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    mla = ModelConfig.from_dict(raw)
    assert mla.kv_cache_shapes() == ((1, 576),) and mla.kv_cache_shapes(4) == ((1, 576),)
    assert mla.kv_bytes_per_token(torch.bfloat16) == 3 * 576 * 2
    assert mla.kv_bytes_per_token(torch.bfloat16, 8) == 3 * 576 * 2
    plain = ModelConfig.from_dict({**raw, "model_type": "llama", "kv_lora_rank": None, "head_dim": 16})
    assert plain.kv_cache_shapes(2) == ((4, 16), (4, 16))
    assert plain.kv_bytes_per_token(torch.float32) == 3 * 2 * 8 * 16 * 4
