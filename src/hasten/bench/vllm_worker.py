"""One vLLM engine serving ``hasten bench``'s vLLM baselines, run by the Python of vLLM's
own environment (``make vllm``), never imported by hasten: vLLM pins other versions of
transformers and torch than hasten's.

Protocol, one JSON object per line: the first line on stdin is the engine's settings
``{"model", "dtype", "max_model_len", "speculative": null | vLLM's speculative_config}``; the worker
answers (each answer on one stdout line after ``@@hasten ``) ``{"ready": true, "vllm": version, "dtype": ...}`` once the engine is built. Then
each line ``{"prompt": [ids], "max_tokens": n}`` gets ``{"tokens": [ids], "seconds": s,
"accepted": k, "drafts": d, "accepted_per_position": [a_1, ...]}``: greedy, EOS ignored (unless
``"stop_at_eos": true``; ``"structured"``: vLLM's ``StructuredOutputsParams`` fields), no
prefix caching (every request prefills its prompt), timed around ``LLM.generate`` alone;
``accepted`` counts the draft tokens vLLM accepted, ``drafts`` the steps that proposed a draft,
and ``accepted_per_position[i]`` the drafts whose position i + 1 was accepted (all 0 without
speculation). An empty line or EOF ends it.
"""
import json
import os
import sys
import time

SPEC_COUNTER = "vllm:spec_decode_num_accepted_tokens"
DRAFTS_COUNTER = "vllm:spec_decode_num_drafts"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"  # a vector: one count per draft position
MARK = "@@hasten "  # begins every protocol line on stdout; vLLM and its engine process may print too


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def spec_counts(llm) -> dict:
    """vLLM's speculation counters so far: accepted tokens, drafts, accepted per position."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics off in this vLLM: tau stays unknown (0 accepted)
        return {"accepted": 0, "drafts": 0, "accepted_per_position": []}
    total = {SPEC_COUNTER: 0, DRAFTS_COUNTER: 0}
    per_position: list[int] = []
    for m in metrics:
        if m.name in total:
            total[m.name] += int(getattr(m, "value", 0))
        elif m.name == PER_POSITION:
            values = [int(v) for v in getattr(m, "values", [])]
            per_position = [a + b for a, b in zip(per_position + [0] * len(values), values)]
    return {"accepted": total[SPEC_COUNTER], "drafts": total[DRAFTS_COUNTER], "accepted_per_position": per_position}


def since(before: dict, after: dict) -> dict:
    early = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    return {"accepted": after["accepted"] - before["accepted"], "drafts": after["drafts"] - before["drafts"],
            "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"], early)]}


def main() -> None:
    settings = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for one request
    from vllm import LLM, SamplingParams, __version__

    options = dict(model=settings["model"], dtype=settings["dtype"], enforce_eager=True,
                   enable_prefix_caching=False, max_model_len=settings["max_model_len"], seed=0,
                   gpu_memory_utilization=0.2, disable_log_stats=False)
    if settings.get("speculative"):
        options["speculative_config"] = settings["speculative"]
    llm = LLM(**options)
    say({"ready": True, "vllm": __version__, "dtype": settings["dtype"]})
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        structured = request.get("structured")  # vLLM's StructuredOutputsParams fields (hasten bench-json)
        if structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            structured = StructuredOutputsParams(**structured)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                                ignore_eos=not request.get("stop_at_eos", False), detokenize=False,
                                structured_outputs=structured)
        before = spec_counts(llm)
        clock = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
        seconds = time.perf_counter() - clock
        say({"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds, **since(before, spec_counts(llm))})


if __name__ == "__main__":
    main()
