"""One vLLM engine serving ``hasten bench``'s vLLM baselines, run by the Python of vLLM's
own environment (``make vllm``), never imported by hasten: vLLM pins other versions of
transformers and torch than hasten's.

Protocol, one JSON object per line: the first line on stdin is the engine's settings
``{"model", "dtype", "max_model_len", "speculative": null | vLLM's speculative_config}``; the worker
answers (each answer on one stdout line after ``@@hasten ``) ``{"ready": true, "vllm": version, "dtype": ...}`` once the engine is built. Then
each line ``{"prompt": [ids], "max_tokens": n}`` gets ``{"tokens": [ids], "seconds": s,
"accepted": k}``: greedy, EOS ignored, no prefix caching (every request prefills its
prompt), timed around ``LLM.generate`` alone; ``accepted`` counts the draft tokens vLLM
accepted (0 without speculation). An empty line or EOF ends it.
"""
import json
import os
import sys
import time

SPEC_COUNTER = "vllm:spec_decode_num_accepted_tokens"
MARK = "@@hasten "  # begins every protocol line on stdout; vLLM and its engine process may print too


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def accepted_so_far(llm) -> int:
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics off in this vLLM: tau stays unknown (0 accepted)
        return 0
    return int(sum(getattr(m, "value", 0) for m in metrics if m.name == SPEC_COUNTER))


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
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                                detokenize=False)
        before = accepted_so_far(llm)
        clock = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
        seconds = time.perf_counter() - clock
        say({"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds,
             "accepted": accepted_so_far(llm) - before})


if __name__ == "__main__":
    main()
