"""Train the small Llama-architecture demo model that ships in `fastgen/demo_model/`.

`fastgen.pipeline()` loads this model when no model is named, and `make demo` runs it. It is
trained only on text that ships with every Python (the `pydoc_data` topics and standard-library
docstrings), so it can be rebuilt anywhere, offline, in well under an hour on 2 CPU cores:

    python scripts/train_demo_model.py                 # 2000 steps: 35 minutes on 2 shared cores
    python scripts/train_demo_model.py --quick --out /tmp/demo   # smoke run, under a minute

The corpus is only ~0.6 M tokens, so longer runs memorise it: at 2000 steps the train loss fell
to 0.86 while the held-out loss rose from 3.30 (step 1250) to 3.58; the shipped model is that
run, whose greedy text reads more fluently than the 1200-step one. The output is English-looking
text about Python, not meaningful answers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import math
import os
import random
import time
from argparse import Namespace
from pathlib import Path

# On shared cores, OpenMP threads that spin while waiting for a descheduled sibling made steps up
# to 10x slower; sleeping threads cost little when the cores are idle. Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pydoc_data.topics  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)

# Modules without import side effects (no GUI, no browser, no printing), walked in this order.
STDLIB_MODULES = sorted("""
    abc argparse array ast asyncio base64 bdb binascii bisect builtins bz2 calendar cmath cmd code codecs
    codeop collections colorsys compileall concurrent.futures configparser contextlib contextvars copy
    copyreg cProfile csv ctypes dataclasses datetime dbm decimal difflib dis doctest email email.message
    email.mime.text email.policy enum errno filecmp fileinput fnmatch fractions ftplib functools gc getopt
    getpass gettext glob graphlib gzip hashlib heapq hmac html html.parser http http.client http.cookiejar
    http.cookies http.server imaplib importlib importlib.abc importlib.metadata importlib.resources
    inspect io ipaddress itertools json json.decoder json.encoder keyword linecache locale logging
    logging.config logging.handlers lzma mailbox marshal math mimetypes modulefinder multiprocessing
    multiprocessing.pool netrc numbers opcode operator optparse os os.path pathlib pdb pickle pickletools
    pkgutil platform plistlib poplib pprint profile pstats py_compile pyclbr queue quopri random re
    reprlib rlcompleter runpy sched secrets selectors shelve shlex shutil signal site smtplib socket
    socketserver sqlite3 ssl stat statistics string stringprep struct subprocess symtable sys sysconfig
    tabnanny tarfile tempfile textwrap threading time timeit token tokenize tomllib trace traceback
    tracemalloc types typing unicodedata unittest unittest.mock urllib.parse urllib.request uuid warnings
    wave weakref wsgiref.handlers wsgiref.simple_server xml.dom.minidom xml.etree.ElementTree xml.sax
    xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib zoneinfo
""".split())
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = ["The module", "A function is", "Python is"]
CHAT_PROMPT = [{"role": "user", "content": "What is json.dumps?"}]
SEED = 0
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "fastgen" / "demo_model"


def module_docstrings(name: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of a module and of its classes, functions and methods."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        module = importlib.import_module(name)
    docs = [(name, inspect.getdoc(module))]
    for attr, obj in sorted(vars(module).items()):
        if inspect.isclass(obj) or inspect.isroutine(obj):
            docs.append((f"{name}.{attr}", inspect.getdoc(obj)))
        if inspect.isclass(obj):
            docs += [(f"{name}.{attr}.{m}", inspect.getdoc(f))
                     for m, f in sorted(vars(obj).items()) if inspect.isroutine(f)]
    return [(n, d.strip()) for n, d in docs if d and len(d) >= 40]


def build_corpus() -> tuple[list[str], list[str]]:
    """Plain documents (pydoc topics, stdlib docstrings) and chat examples, deduplicated."""
    docs = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
    named: dict[str, str] = {}
    for module in STDLIB_MODULES:
        try:
            pairs = module_docstrings(module)
        except Exception as exc:  # a module missing on this platform or Python version
            print(f"skip {module}: {type(exc).__name__}: {exc}")
            continue
        docs += [d for _, d in pairs]
        named.update((n, d) for n, d in pairs if n not in named)
    # Chat examples in the shape CHAT_TEMPLATE renders, so a chat prompt gets a docstring back;
    # one per distinct answer, public names only.
    answers: dict[str, str] = {}
    for name, doc in named.items():
        if "._" not in name:
            answers.setdefault(doc.split("\n\n")[0], name)
    chats = [f"<|user|>What is {n}?</s><|assistant|>{a}" for a, n in answers.items()]
    return list(dict.fromkeys(docs)), chats


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer that prepends `<s>`, wrapped for `transformers`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(  # Llama-style: every encoding starts with <s>
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>",
        model_max_length=1024, chat_template=CHAT_TEMPLATE)


def pack(docs: list[str], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> torch.Tensor:
    """Shuffle documents, join them as `<s> doc </s>` and cut the stream into [N, seq_len] rows."""
    order = list(range(len(docs)))
    random.Random(SEED).shuffle(order)
    encodings = tokenizer.backend_tokenizer.encode_batch([docs[i] for i in order])
    ids = [t for enc in encodings for t in enc.ids + [tokenizer.eos_token_id]]
    rows = len(ids) // seq_len
    return torch.tensor(ids[: rows * seq_len]).view(rows, seq_len)


def make_model(args: Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A small Llama with grouped-query attention (8 query heads over 4 KV heads)."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def lr_at(step: int, args: Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, rows: torch.Tensor, args: Namespace) -> float:
    """Mean next-token loss over held-out rows."""
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        losses = [model(input_ids=b, labels=b).loss.item() for b in rows.split(args.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train(model: LlamaForCausalLM, rows: torch.Tensor, eval_rows: torch.Tensor, args: Namespace) -> dict:
    """AdamW over packed rows, reshuffled every epoch, for `args.steps` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(SEED)
    perm, cursor = torch.randperm(len(rows), generator=gen), 0
    start, smooth = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        if cursor + args.batch_size > len(rows):
            perm, cursor = torch.randperm(len(rows), generator=gen), 0
        batch = rows[perm[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):  # fp32 master weights
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        elapsed = time.perf_counter() - start
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.3f}  smoothed {smooth:.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed / 60:.1f} min", flush=True)
        if step % (10 * args.log_every) == 0:
            print(f"step {step:5d}  held-out loss {eval_loss(model, eval_rows, args):.3f}", flush=True)
    return {"steps": args.steps, "train_loss": smooth, "minutes": (time.perf_counter() - start) / 60}


def write_readme(out: Path, args: Namespace, info: dict, samples: list[str]) -> None:
    """A short model card: what the model is, how it was trained, what to expect of it."""
    sample_lines = "\n".join(f"    {s!r}" for s in samples)
    (out / "README.md").write_text(f"""# fastgen demo model

A tiny Llama-architecture causal LM: {info['params'] / 1e6:.1f} M parameters, {args.layers} layers,
hidden 256, 8 query heads over 4 KV heads (GQA), vocab {info['vocab']}, tied embeddings, bf16 weights.
`fastgen.pipeline()` uses it when no model is named, and `make demo` runs it.

It was trained from scratch on text that ships with every Python: the `pydoc_data` help topics and
docstrings of standard-library modules ({info['docs']} documents plus {info['chats']} chat examples
"What is <name>?" -> first paragraph of its docstring; {info['tokens'] / 1e6:.2f} M tokens), with a
byte-level BPE tokenizer trained on the same text. Its output is English-looking text about Python,
but it is not meaningful: use it to try the engine, not to answer questions.

Training: `python scripts/train_demo_model.py --steps {info['steps']}` on 2 shared CPU cores
(`torch.set_num_threads(2)`, bf16 autocast: {args.bf16}), AdamW with linear warm-up and cosine
decay, batch {args.batch_size} x {args.seq_len} packed tokens,
{info['steps']} steps in {info['minutes']:.1f} minutes.
Final train loss (smoothed) {info['train_loss']:.3f}, held-out loss {info['eval_loss']:.3f}.

Greedy continuations (30 new tokens, the last one through the chat template):

{sample_lines}
""")


def main() -> None:
    """Parse flags, build corpus and tokenizer, train, save, and print sample continuations."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (see the docstring)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small corpus, 2 layers, 6 steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.layers, args.batch_size, args.vocab_size = 6, 2, 4, 1024
        args.warmup, args.log_every = 2, 3
    torch.set_num_threads(2)  # the documented budget: 2 CPU cores
    torch.manual_seed(SEED)

    docs, chats = build_corpus()
    if args.quick:
        docs, chats = docs[:50], chats[:50]
    tokenizer = train_tokenizer(docs, args.vocab_size)
    rows = pack(docs + chats, tokenizer, args.seq_len)
    held_out = max(1, len(rows) // 50)
    eval_rows, train_rows = rows[:held_out], rows[held_out:]
    print(f"{len(docs)} documents + {len(chats)} chats: {rows.numel()} tokens in {len(rows)} rows")

    model = make_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters, {args.layers} layers")
    info = train(model, train_rows, eval_rows, args)
    info.update(params=params, vocab=len(tokenizer), docs=len(docs), chats=len(chats),
                tokens=rows.numel(), eval_loss=eval_loss(model, eval_rows, args))
    print(f"done: {info['steps']} steps in {info['minutes']:.1f} min, train loss {info['train_loss']:.3f}, "
          f"held-out loss {info['eval_loss']:.3f}")

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=30)
    inputs = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    chat = tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, return_dict=True)
    inputs.append(torch.tensor([chat["input_ids"]]))
    with torch.no_grad():
        samples = [tokenizer.decode(model.generate(ids)[0], skip_special_tokens=True) for ids in inputs]
    print("\n".join(f"--- {s!r}" for s in samples))

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    write_readme(args.out, args, info, samples)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
