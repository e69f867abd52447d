"""What `dflash bench` writes: the results table (printed and in results.md), the report around it, the plots, and
results.json / per_prompt.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

def markdown_table(results: dict) -> str:
    lines = ["| method | tau | speedup | e2e speedup | tokens/s | TPOT ms | TTFT ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for method, s in results["methods"].items():
        tau = f"{s['tau']:.2f}{_between(s.get('tau_ci95'))}" if "tau" in s else ("1.00" if method == "ar" else "-")
        name = method
        if method in results.get("llamacpp", {}):  # its weights are not the target's: say which they are
            name = f"{method} ({results['llamacpp'][method]['quantization']} GGUF)"
        speedup = _times(s.get("speedup", 1.0)) + _between(s.get("speedup_ci95"), "x")
        e2e = _times(s.get("e2e_speedup", 1.0)) + _between(s.get("e2e_speedup_ci95"), "x")
        lines.append(f"| {name} | {tau} | {speedup} | {e2e} | {s['tokens_per_s']:.1f} | {s['tpot_ms']:.2f} "
                     f"| {s['ttft_ms']:.1f} |")
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _between(bounds: list[float] | None, unit: str = "") -> str:
    return "" if not bounds else f" ({bounds[0]:.2f}-{bounds[1]:.2f}{unit})"


def attention_note(kernels: dict) -> str:
    """", attention: flash (measured)" where the load chose the SDPA backends by measurement (a CUDA target)."""
    attention = kernels.get("attention") or {}
    if not attention.get("measured"):
        return ""
    per_call = ", ".join(f"{name} {ms:.3g}" for name, ms in attention["ms_per_call"].items())
    return f", attention: {attention['sdpa']} (ms per call: {per_call})"


def machine_line(machine: dict) -> str:
    """One line naming what the figures ran on: the GPU, or the CPU with its instruction sets and threads."""
    cpu = machine.get("cpu") or {}
    where = machine.get("gpu") or " ".join(
        filter(None, [cpu.get("model") or machine.get("processor", "?"),
                      f"family {cpu['family']} model {cpu['model_number']}" if cpu.get("family") else "",
                      f"({', '.join(cpu['isa'])})" if cpu.get("isa") else ""]))
    return (f"{where}, {machine.get('cpu_count', '?')} cores, {machine.get('torch_threads', '?')} torch threads, "
            f"torch {machine.get('torch', '?')}")


def memory_lines(memory: dict | None) -> list[str]:
    if not memory or memory.get("resident_mb_after_loading") is None:
        return []
    line = (f"memory: {memory['resident_mb_after_loading']} MB resident after loading, "
            f"{memory['peak_resident_mb']} MB at the peak")
    if "cuda_peak_allocated_mb" in memory:
        line += f"; GPU: {memory['cuda_peak_allocated_mb']} MB allocated at the peak"
    return ["", line]


def graph_capture_lines(captures: dict | None, retimed: dict | None = None) -> list[str]:
    if not captures:
        return []
    parts = [f"target {captures['target']['graphs']} in {captures['target']['capture_seconds']} s"]
    parts += [f"drafter {d['graphs']} in {d['capture_seconds']} s" for d in captures.get("drafters", [])]
    lines = [f"CUDA graphs captured (compiles included): {', '.join(parts)}"]
    if retimed:  # run_on_replays
        counts = ", ".join(f"{method} {n}" for method, n in retimed.items())
        lines.append(f"runs that captured graphs, timed again on replays: {counts}")
    return lines + [""]


def interrupted_note(results: dict) -> str:
    cut = results.get("interrupted")
    return f" (interrupted: {cut['prompts_done']} of the {cut['prompts_asked']} asked)" if cut else ""


def markdown_report(results: dict, plots: list[str], note: str | None) -> str:
    mismatches = results["greedy_mismatches"]
    lines = [
        f"# dflash bench: {results['dataset']}",
        "",
        f"`{results['command']}`",
        "",
        f"target `{results['target']}` ({results['dtype']}, {results['device']}"
        f"{', CUDA graphs' if results.get('cuda_graphs') else ''}"
        f"{' (compiled)' if results.get('compiled_graphs') else ''}{attention_note(results.get('kernels') or {})}), "
        f"{results['num_prompts']} prompts{interrupted_note(results)} "
        f"({results['num_generations']} generations per method), max {results['max_new_tokens']} new tokens, "
        f"T={results['temperature']}, {results['date']}",
        "",
        f"machine: {machine_line(results.get('machine', {}))}",
        *memory_lines(results.get("memory")),
        "",
        *graph_capture_lines(results.get("graph_captures"), results.get("retimed_runs")),
        markdown_table(results),
        "",
        "speedup = ar TPOT / method TPOT (decode); e2e speedup = tokens/s ratio including TTFT; in brackets, 95% "
        f"intervals over the prompts (paired bootstrap, {results.get('bootstrap_resamples')} resamples).",
        "",
        "greedy mismatches vs ar: "
        f"{mismatch_summary(results['mismatches']) if mismatches is not None else 'not compared (sampling)'}",
    ]
    if "ar_vs_hf_tokens_per_s" in results:
        lines.append(f"ar vs transformers generate: ar runs at {results['ar_vs_hf_tokens_per_s']:.2f}x hf's tokens/s")
    lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    if note:
        lines.append(note)
    return "\n".join(lines) + "\n"


def write_plots(out_dir: Path, results: dict) -> tuple[list[str], str | None]:
    """PNG plots; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: plots skipped (pip install 'dflash[plot]')"
    speculative = {m: s for m, s in results["methods"].items() if "tau" in s}
    written = []
    if speculative:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(speculative)
        for i, (method, s) in enumerate(speculative.items()):
            hist = s["tau_histogram"]
            share = [h / max(1, sum(hist)) for h in hist]
            ax.bar([k + 1 + (i - (len(speculative) - 1) / 2) * width for k in range(len(hist))], share, width,
                   label=f"{method} (tau {s['tau']:.2f})")
        ax.set(xlabel="tokens emitted per verify round", ylabel="share of rounds", title="acceptance length")
        ax.legend()
        written.append(_save(fig, out_dir / "tau_histogram.png"))

        fig, ax = plt.subplots(figsize=(7, 4))
        for method, s in speculative.items():
            acc = s["per_position_acceptance"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=method)
        ax.set(xlabel="draft position k", ylabel="fraction of rounds accepted", ylim=(0, 1.02),
               title="per-position acceptance")
        ax.legend()
        written.append(_save(fig, out_dir / "per_position_acceptance.png"))

    others = {m: s for m, s in results["methods"].items() if m != "ar"}
    if others:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(others), [s["speedup"] or 0.0 for s in others.values()], color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set(ylabel="speedup over ar (TPOT)", title=f"{results['dataset']}: speedup")
        written.append(_save(fig, out_dir / "speedup.png"))
    plt.close("all")
    return written, None


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def write_outputs(out_dir: Path, results: dict, rows: list[dict]) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    with (out_dir / "per_prompt.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    plots, note = write_plots(out_dir, results)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    (out_dir / "results.md").write_text(markdown_report(results, plots, note))
    print(markdown_table(results))
    mismatches = results["greedy_mismatches"]
    print(f"\ngreedy mismatches vs ar: "
          f"{mismatch_summary(results['mismatches']) if mismatches is not None else 'not compared (sampling)'}")
    if "ar_vs_hf_tokens_per_s" in results:
        print(f"ar vs transformers generate: {results['ar_vs_hf_tokens_per_s']:.2f}x hf tokens/s")
    print(f"results: {out_dir / 'results.json'}")


def mismatch_summary(mismatches: list[dict]) -> str:
    """"3" or "3 (largest logit gap at the first difference: 0.031)" (logit_gap)."""
    gaps = [abs(m["logit_gap"]) for m in mismatches if m.get("logit_gap") is not None]
    return f"{len(mismatches)}" + (f" (largest logit gap at the first difference: {max(gaps):.3g})" if gaps else "")
