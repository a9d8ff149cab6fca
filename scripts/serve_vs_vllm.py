"""``hasten serve`` against vLLM's OpenAI server on the same CPU, in one run: starts each server
(hasten's with its defaults, vLLM's CPU build from its own environment, plain and with n-gram
speculation), waits for them, runs ``hasten serve-bench`` over all of them level by level (the same
prompts, greedy, each answer compared with the first server's), writes the table, the JSON and the
chart, and stops them. docs/serve.md quotes its output.

    python scripts/serve_vs_vllm.py --model zoo:smollm2-135m --concurrency 1,4,8,16,32 --requests 30 \\
        --out bench-out/serve

vLLM comes from ``$HASTEN_VLLM_PYTHON`` or ``.venv-vllm`` (``make vllm``). Each server computes on
one thread (vLLM's OpenMP threads bound to one core, hasten's ``--threads 1``), eager, in one
dtype (``--dtype``, float32 unless told).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_directory(name: str) -> str:
    """The directory hasten loads ``name`` from (vLLM reads the same files)."""
    from hasten.loading import load_model

    model = load_model(name)
    return model.config._name_or_path


def vllm_command(python: str, directory: str, name: str, port: int, max_seqs: int, speculative: dict | None,
                 dtype: str) -> list[str]:
    command = [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--served-model-name",
               name, "--dtype", dtype, "--enforce-eager", "--max-num-seqs", str(max_seqs), "--port", str(port),
               "--seed", "0"]
    if speculative:
        command += ["--speculative-config", json.dumps(speculative)]
    return command


def start(command: list[str], env: dict, log: Path, port: int, timeout: float) -> subprocess.Popen:
    from hasten.bench.serve_load import wait_until_healthy

    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_until_healthy(process, port, timeout, lambda: f"its log: {log}")
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--servers", default="hasten,vllm,vllm_ngram",
                        help="which to run, in this order (the first is the answers' reference): hasten, "
                        "hasten_plain (hasten's autoregressive method), hasten_METHOD (e.g. hasten_suffix), vllm, vllm_ngram")
    parser.add_argument("--concurrency", default="1,4,8,16,32")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", default="spec-bench:5")
    parser.add_argument("--max-batch", type=int, default=32, help="rows decoded together (hasten's --max-batch, "
                        "vLLM's --max-num-seqs)")
    parser.add_argument("--vllm-python", default=os.environ.get("HASTEN_VLLM_PYTHON", ".venv-vllm/bin/python"))
    parser.add_argument("--kv-cache-gib", default="2", help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="every server's dtype (vLLM's CPU default is bfloat16 where the CPU has bf16 instructions)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--long-prompt", type=int, help="serve-bench's: in each level one more client sends a "
                        "prompt of about this many tokens once the streams run (its ITL effect, its own TTFT)")
    parser.add_argument("--out", default="bench-out/serve")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    directory = model_directory(args.model)
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib}
    processes, urls = [], []
    try:
        for name in args.servers.split(","):
            port = free_port()
            if name == "hasten" or name.startswith("hasten_"):  # hasten (its default), hasten_plain, hasten_METHOD
                method = {"hasten": "prompt_lookup", "hasten_plain": "autoregressive"}.get(name, name[len("hasten_"):])
                command = [sys.executable, "-m", "hasten", "serve", "--model", args.model, "--method", method,
                           "--port", str(port), "--max-batch", str(args.max_batch), "--threads", "1", "--dtype", args.dtype]
                env = dict(os.environ)
            elif name in ("vllm", "vllm_ngram"):
                command = vllm_command(args.vllm_python, directory, args.model, port, args.max_batch,
                                       NGRAM if name == "vllm_ngram" else None, args.dtype)
                env = {**os.environ, **binding}
            else:
                raise SystemExit(f"unknown server {name!r}")
            print(f"starting {name}: {' '.join(command)}", file=sys.stderr, flush=True)
            processes.append(start(command, env, out / f"{name}.log", port, args.start_timeout))
            urls.append(f"{name}=http://127.0.0.1:{port}/v1")
        bench = [sys.executable, "-m", "hasten", "serve-bench", "--chat", "--prompts", args.prompts, "--max-tokens",
                 str(args.max_tokens), "--concurrency", args.concurrency, "--requests", str(args.requests),
                 "--out", str(out / "serve-bench.json"), "--chart", str(out / "serve-bench.png")]
        if args.long_prompt:
            bench += ["--long-prompt", str(args.long_prompt)]
        for url in urls:
            bench += ["--url", url]
        with open(out / "uptime-before.txt", "w") as f:
            f.write(open("/proc/loadavg").read())
        result = subprocess.run(bench, capture_output=True, text=True)
        with open(out / "uptime-after.txt", "w") as f:
            f.write(open("/proc/loadavg").read())
        (out / "serve-bench.md").write_text(result.stdout)
        print(result.stdout)
        print(result.stderr[-3000:], file=sys.stderr)
        return result.returncode
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())
