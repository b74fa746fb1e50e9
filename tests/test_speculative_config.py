"""speculative_config (vLLM's keys), its plan field and choice, and the n-gram prompt-lookup proposer."""

import json

import pytest

from fastgen.config import EngineConfig
from fastgen.engine.ngram_proposer import NgramProposer
from fastgen.planning.cli import main as planning_main
from fastgen.planning.speculative import (SpeculativeConfig, choose_disable_by_batch_size,
                                          parse_speculative_config, step_time_model)

DEMO = "fastgen/demo_model"


def test_ngram_config_takes_vllms_keys_and_defaults():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == \
        ("ngram", 3, 5, 5)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}') \
        == SpeculativeConfig("ngram", 2, 4, 4)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 3}).prompt_lookup_min == 2
    draft = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 4, "quantization": "int8"})
    assert (draft.method, draft.model, draft.quantization) == ("draft_model", "/some/draft", "int8")
    assert parse_speculative_config(None) is None and parse_speculative_config("null") is None


@pytest.mark.parametrize("bad,error,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "not implemented yet"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, ValueError, "not implemented yet"),
    ({"method": "medusa", "num_speculative_tokens": 1}, ValueError, "not implemented yet"),
    ({"method": "magic", "num_speculative_tokens": 1}, ValueError, "must be one of"),
    ({"num_speculative_tokens": 1}, ValueError, "needs \"method\""),
    ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be in"),
    ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ValueError, "must be <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ValueError, "is for a draft model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, ValueError, "is for method \"ngram\""),
    ({"model": "x", "num_speculative_tokens": 2, "quantization": "fp4"}, ValueError, "quantization must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, ValueError, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, ValueError, ">= 0"),
    ("{not json", ValueError, "not valid JSON"),
    (3, TypeError, "must be a dict"),
])
def test_bad_configs_are_refused_naming_the_key(bad, error, match):
    with pytest.raises(error, match=match):
        parse_speculative_config(bad)


def test_engine_keyword_and_plan_field(capsys):
    config = EngineConfig.from_kwargs(None, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.plan_overrides()["speculative_config"]["method"] == "ngram"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert planning_main([DEMO, "--speculative-config", spec]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("speculative_config")][0]
    assert '"method":"ngram"' in row and "disable_by_batch_size" in row and "above, speculation is off" in row
    assert planning_main([DEMO]) == 0
    assert "off: no speculative_config given" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse refuses the flag's value
        planning_main([DEMO, "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 1}'])
    assert "not implemented yet" in capsys.readouterr().err


def test_a_draft_model_must_share_the_vocabulary(tmp_path, capsys):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads(open(f"{DEMO}/config.json").read())
    config["vocab_size"] += 1
    (draft / "config.json").write_text(json.dumps(config))
    bad = json.dumps({"model": str(draft), "num_speculative_tokens": 2})
    assert planning_main([DEMO, "--speculative-config", bad]) == 2
    assert "must share the target's vocabulary" in capsys.readouterr().err


def test_disable_by_batch_size_is_where_verifying_stops_paying():
    # 10 ms to stream the weights, 1 ms of matmul per token: a 5-token row is free until the matmuls dominate.
    step = step_time_model(weight_bytes=10**9, active_params=5 * 10**8, flops=10**12, stream_gbps=100.0)
    config = SpeculativeConfig("ngram", 4, 2, 3)
    chosen, why = choose_disable_by_batch_size(config, step, lambda tokens: 0.0, 64, "test rates")
    # Pays while 2.77 x max(10, B) > max(10, 5B) ms: up to B = 5 (13.8 > 25? no: B=5: 27.7 > 25 yes; B=6: 27.7 < 30).
    assert chosen.disable_by_batch_size == 5 and "pays up to B=5" in why
    expensive_draft = choose_disable_by_batch_size(config, step, lambda tokens: 0.01, 64, "r")[0]
    assert expensive_draft.disable_by_batch_size == 0
    mine = choose_disable_by_batch_size(SpeculativeConfig("ngram", 4, 2, 3, disable_by_batch_size=3), step,
                                        lambda t: 0.0, 64, "r")
    assert mine[0].disable_by_batch_size == 3 and mine[1].startswith("set by the user")


@pytest.mark.parametrize("tokens,expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], [4, 9, 1]),            # 3-gram [1, 2, 3] recurs: copy what followed
    ([5, 1, 2, 7, 7, 1, 2, 8, 9, 1, 2], [8, 9, 1]),   # two matches of [1, 2]: the most recent one
    ([1, 2, 3, 4, 5, 6], []),                          # nothing recurs
    ([7, 2, 3, 8, 2, 3, 9, 1, 2, 3], [9, 1, 2]),      # longest n first: [1,2,3]? only [2,3] recurs -> most recent
    ([4, 4, 4, 4], [4]),                               # overlapping match, limited by what follows it
])
def test_ngram_lookup(tokens, expected):
    assert NgramProposer(3, 2, 3).propose(tokens) == expected


def test_ngram_prefers_the_longer_match_and_respects_limits():
    #         a longer match (3-gram 1,2,3) early, a shorter (2,3) later
    tokens = [1, 2, 3, 50, 51, 52, 9, 2, 3, 60, 61, 1, 2, 3]
    assert NgramProposer(2, 2, 3).propose(tokens) == [50, 51]
    assert NgramProposer(2, 2, 2).propose(tokens) == [60, 61]  # only 2-grams: the most recent
    assert NgramProposer(5, 2, 3).propose(tokens, max_tokens=1) == [50]
    assert NgramProposer(2, 4, 4).propose(tokens) == []        # no 4-gram recurs
    assert NgramProposer(2, 2, 3).propose([1, 2]) == []
