"""lm-eval 0.4.13, unmodified, against the real server: `--model local-completions` on two small
local tasks (a `multiple_choice` task, scored by loglikelihoods of `echo` + `logprobs` requests, and
a greedy `generate_until` task, whose requests carry a `seed`), run as a subprocess over loopback.
Its scores and every per-sample loglikelihood (within 1e-4) and generation must equal what lm-eval's
own Hugging Face backend gives on the same fp32 checkpoint and tasks.

lm-eval comes with the `compat` extra (`make test` installs it); without it the test is skipped.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from rest_server import serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm-eval is not installed: pip install -e '.[compat]' (lm-eval[api]==0.4.13)")

MODEL = "tiny-llama"
ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
TOL = 1e-4
MC_DOCS = [
    ("The quick brown fox jumps over the", [" lazy dog", " moon", " red car", " string of pearls"], 0),
    ("def main():", [" return 0", " pass", " print('hi')", " while True"], 1),
    ("A list in Python is", [" mutable", " immutable", " a tuple", " a keyword"], 0),
    ("The for statement is used to", [" iterate", " define a class", " import a module", " raise"], 0),
    ("Exceptions are raised with", [" raise", " throw", " error", " except"], 0),
    ("Strings are", [" immutable sequences", " mutable", " numbers", " functions"], 0),
]
GEN_DOCS = [("The quick brown fox", "jumps"), ("def main():", "pass"), ("The import statement", "loads"),
            ("A dictionary maps", "keys")]


def _write_tasks(root) -> str:
    """The two tasks as YAML files over JSONL data in `root`; returns the include path."""
    with open(root / "mc.jsonl", "w") as f:
        for question, choices, answer in MC_DOCS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for prompt, target in GEN_DOCS:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    (root / "fastgen_mc.yaml").write_text(f"""task: fastgen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (root / "fastgen_gen.yaml").write_text(f"""task: fastgen_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return str(root)


def _lm_eval(model: str, model_args: str, tasks: str, out: str, cache: str) -> tuple[dict, dict[str, list], str]:
    """Run the lm-eval CLI; returns (results, per-task samples, the table it printed)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": cache, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks",
           "fastgen_mc,fastgen_gen", "--include_path", tasks, "--batch_size", "1", "--output_path", out,
           "--log_samples"]
    if model == "hf":
        cmd += ["--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (results_file,) = glob.glob(os.path.join(out, "*", "results_*.json"))
    samples = {}
    for task in ("fastgen_mc", "fastgen_gen"):
        (path,) = glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl"))
        with open(path) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    table = proc.stdout[proc.stdout.find("|"):]
    with open(results_file) as f:
        return json.load(f)["results"], samples, table


def test_lm_eval_scores_through_the_server_equal_its_hf_backend(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["llama"]
    tasks = _write_tasks(tmp_path)
    cache = str(tmp_path / "hf-datasets")
    hf, hf_samples, hf_table = _lm_eval("hf", f"pretrained={checkpoint},dtype=float32", tasks,
                                        str(tmp_path / "out-hf"), cache)
    with serve(checkpoint, MODEL, ENGINE) as served:
        args = (f"model={MODEL},base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={checkpoint},tokenized_requests=True,max_retries=1,timeout=60")
        api, api_samples, api_table = _lm_eval("local-completions", args, tasks, str(tmp_path / "out-api"), cache)
    print("lm-eval hf backend:\n" + hf_table + "\nlm-eval local-completions through fastgen:\n" + api_table)

    for ours, theirs in zip(api_samples["fastgen_mc"], hf_samples["fastgen_mc"]):
        mine = [float(r[0][0]) for r in ours["resps"]]
        reference = [float(r[0][0]) for r in theirs["resps"]]
        assert mine == pytest.approx(reference, abs=TOL), ours["doc_id"]
        # A random tiny model must still separate the choices, or agreeing on acc would prove little.
        assert min(abs(a - b) for i, a in enumerate(reference) for b in reference[i + 1:]) > 0.1
    for ours, theirs in zip(api_samples["fastgen_gen"], hf_samples["fastgen_gen"]):
        assert ours["resps"] == theirs["resps"] and ours["resps"][0][0], ours["doc_id"]
    for task, metrics in (("fastgen_mc", ("acc,none", "acc_norm,none")), ("fastgen_gen", ("exact_match,none",))):
        for metric in metrics:
            assert api[task][metric] == hf[task][metric], (task, metric)
    assert 0 < hf["fastgen_mc"]["acc,none"] < 1  # some documents right, some wrong
