"""Our models vs Hugging Face transformers on the same tiny fp32 checkpoints.

Prompt logits must match within fp32 tolerance and 32 greedy steps through the paged KV cache
must give exactly HF's tokens, with several sequences of different lengths in one flat batch and
a block size smaller than the prompts.
"""

import pydoc_data.topics
import pytest
import torch
import transformers

from fastgen.models.loader import load_model
from kit import TINY_CONFIGS, PagedRunner

PROMPT_LENGTHS = [1, 3, 9, 17, 30, 47]
NUM_DECODE = 32


def _prompts(tokenizer) -> list[list[int]]:
    text = pydoc_data.topics.topics["if"] + pydoc_data.topics.topics["while"]
    ids = tokenizer.encode(text)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def _hf(path: str):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_prefill_logits_and_greedy_match_hf(model_type, tiny_checkpoints):
    path = tiny_checkpoints[model_type]
    ours = load_model(path, progress=False).model
    hf = _hf(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tokenizer)

    runner = PagedRunner(ours, block_size=8)
    seqs = [runner.add(p) for p in prompts]
    logits = runner.step([(s, len(s.token_ids)) for s in seqs])
    offset = 0
    with torch.inference_mode():
        for prompt in prompts:
            expected = hf(torch.tensor([prompt])).logits[0]
            got = logits[offset : offset + len(prompt)]
            assert expected.std() > 1.0, "tiny model logits are flat: the test would prove nothing"
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            offset += len(prompt)

    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    next_tokens = logits[last].argmax(-1).tolist()
    generated = [[] for _ in prompts]
    for _ in range(NUM_DECODE):
        for seq, tok, out in zip(seqs, next_tokens, generated):
            seq.token_ids.append(tok)
            out.append(tok)
        next_tokens = runner.step([(s, 1) for s in seqs]).argmax(-1).tolist()

    for prompt, out in zip(prompts, generated):
        assert out == _hf_greedy(hf, prompt)
        assert len(set(out)) >= 3, f"greedy output is one token repeated: {out}"
    mean_distinct = sum(len(set(out)) for out in generated) / len(generated)
    assert mean_distinct >= 8, f"greedy outputs are barely varied ({mean_distinct:.1f} distinct tokens of 32)"


# llama4_text: prompt chunks of 13 against attention chunks of 12, so a step's queries straddle chunk starts.
@pytest.mark.parametrize("model_type", ["llama", "mistral", "llama4_text"])
def test_chunked_prefill_mixed_with_decodes_matches_hf(model_type, tiny_checkpoints):
    """SplitFuse-shaped steps: decodes first, then prompt chunks cut to a small token budget."""
    path = tiny_checkpoints[model_type]
    ours = load_model(path, progress=False).model
    hf = _hf(path)
    prompts = _prompts(transformers.AutoTokenizer.from_pretrained(path))
    runner = PagedRunner(ours, block_size=4, seed=1)
    seqs = [runner.add(p) for p in prompts]
    prompt_lens = [len(p) for p in prompts]
    budget, num_new = 13, 12
    while any(len(s.token_ids) - len(p) < num_new for s, p in zip(seqs, prompts)):
        chunks = [(s, 1) for s, n in zip(seqs, prompt_lens)
                  if s.num_computed_tokens >= n and len(s.token_ids) - n < num_new]
        left = budget - len(chunks)
        for s, n in zip(seqs, prompt_lens):
            if s.num_computed_tokens < n and left > 0:
                take = min(left, n - s.num_computed_tokens)
                chunks.append((s, take))
                left -= take
        logits = runner.step(chunks)
        ends = torch.tensor([n for _, n in chunks]).cumsum(0) - 1
        for (s, _), tok in zip(chunks, logits[ends].argmax(-1).tolist()):
            if s.num_computed_tokens == len(s.token_ids):
                s.token_ids.append(tok)
    for s, p in zip(seqs, prompts):
        assert s.token_ids[len(p):len(p) + num_new] == _hf_greedy(hf, p)[:num_new]
