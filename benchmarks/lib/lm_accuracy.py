"""PETRA against backprop on the same RevGPT and text, best against best: each method (an optimizer and a
delay compensation) at its own best learning rate, against backprop at the best learning rate of every
optimizer offered, over pipeline depths J and micro-batches per step k at a fixed global batch.

    # screening (about 500 steps), then confirming the winners at 1,500 steps with two seeds
    OMP_NUM_THREADS=1 python -m benchmarks.accuracy lm --steps 500 --lrs 5e-4 1e-3 2e-3 --stages 4 8 --k 4 \\
        --recipes adamw+wp nadam95 nadam95+wp muon muon+wp --jobs 2
    OMP_NUM_THREADS=1 python -m benchmarks.accuracy lm --steps 1500 --lrs 1e-3 --stages 4 --k 4 \\
        --recipes muon+wp --seeds 0 1

The text is offline and reproducible: the docstrings of this Python's standard library, one paragraph per
line, the last 5% of paragraphs held out. Every run is examples/reformer/train.py: warm-up over 5% of the
steps then cosine decay, dropout 0.1, validation every 100 steps on the first --eval-sequences held-out
sequences, the same text at every k. Backprop is DeepSpeed's engine (1F1B with --procs > 1; with --procs 1 a
single stage: the same arithmetic); PETRA runs its J stages on --procs processes (the placement does not
change PETRA's arithmetic). A run whose summary.json exists is read back instead of run again, so a sweep
can be continued; the report covers every finished run under --run-dir, plus (--earlier) the runs of an
earlier report that are not there, since run directories stay on the machine that made them. A run that
validated on other sequences (before --eval-sequences, the text depended on the micro-batch size) is scored
by its final weights on the protocol's sequences, or left out if it kept none. Prints the best-against-best
table, saves the JSON and one PNG of the winning curves.

Optimizers: adamw, nadam95, nadam99 (constant momentum), muon (Muon at 20x the lr on the hidden matrices, AdamW
at the lr on the rest), muon10 (the same at 10x) and muon10b95 (muon10 with the AdamW part at beta1 0.95).
"""

from __future__ import annotations

import argparse
import ast
import glob
import itertools
import json
import os
import re
import statistics
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from petra_ds.util.files import save_figure, write_text_atomic

from .example_runs import ROOT, launcher, read_run, run_example, save_report

#: steps from which a run counts as a confirming run rather than a screening one
CONFIRM_STEPS = 1500


def nadam(beta1: float) -> dict:
    """torch's NAdam with a constant momentum: momentum_decay so large that mu_t = beta1 from step 1."""
    return {"type": "NAdam", "params": {"betas": [beta1, 0.95], "momentum_decay": 1e9,
                                        "decoupled_weight_decay": True, "weight_decay": 0.01}}


def muon(lr: float) -> dict:
    """DeepSpeed's Muon on the hidden matrices and AdamW on the embedding, norms and head; without a
    ``"muon_lr"`` the example gives Muon ``petra_ds.runtime.config.MUON_LR_RATIO`` times the lr."""
    return {"type": "muon", "params": {"momentum": 0.95, "betas": [0.9, 0.95],
                                       "weight_decay": 0.01, "torch_adam": True}}


def adamw(lr: float) -> dict:
    """The LM example's AdamW."""
    return {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True}}


def muon_at(ratio: float, beta1: float | None = None):
    """Muon at ``ratio`` times the lr on the hidden matrices instead of the example's ratio; ``beta1``: the
    first-moment coefficient of the AdamW part (the embedding, norms and head) instead of 0.9."""
    def config(lr: float) -> dict:
        section = muon(lr)
        section["params"]["muon_lr"] = ratio * lr
        if beta1 is not None:
            section["params"]["betas"] = [beta1, section["params"]["betas"][1]]
        return section
    return config


#: optimizer name -> its config section for a learning rate (the run's --lr fills "lr")
OPTIMIZERS = {"adamw": adamw, "nadam95": lambda lr: nadam(0.95), "nadam99": lambda lr: nadam(0.99),
              "muon": muon_at(20.0), "muon10": muon_at(10.0),
              # the AdamW part at momentum 0.95 (a high momentum absorbs staleness: Zmushko et al. 2026): stage 0,
              # the most delayed, holds the embedding, which the AdamW part steps
              "muon10b95": muon_at(10.0, beta1=0.95)}
#: what a recipe's suffix turns on in "petra.delay_compensation"
COMPENSATIONS = {"wp": "weight_prediction", "am": "adaptive_momentum", "lr": "lr_rescale", "ef": "error_feedback",
                 # weight prediction along an average of the last updates (decay 0.5) instead of the last one
                 "wpa": {"method": "weight_prediction", "beta": 0.5},
                 # half the extrapolation: w + 0.5 s_j d; and beyond it: 1.5 and 2 s_j d
                 "wph": {"method": "weight_prediction", "scale": 0.5},
                 "wp15": {"method": "weight_prediction", "scale": 1.5},
                 "wp2": {"method": "weight_prediction", "scale": 2.0},
                 # momentum lowered, not raised, on delayed stages (asynchrony acts as momentum itself,
                 # Mitliagkas et al. 2016): stage j's moves toward 0.8 by s_j / (s_0 + 1)
                 "aml": {"method": "adaptive_momentum", "beta1_max": 0.8}}


#: what a recipe's suffix sets in the DeepSpeed config, on either side: "nc" turns gradient clipping off
#: (DeepSpeed clips the global gradient norm at 1.0 when a config says nothing, PETRA each stage's own norm)
CONFIG_SUFFIXES = {"nc": {"gradient_clipping": 0}}
#: what a recipe's suffix sets in the "petra" section (PETRA's side only): "fN", stages 1..N keep their exact
#: inputs ("input_buffer": "first_N") instead of reconstructing them; "fa", every stage does ("all"); "sN", the first
#: N steps run synchronously ("synchronous_steps": N)
PETRA_SUFFIXES = {**{f"f{n}": {"input_buffer": f"first_{n}"} for n in (1, 2, 4, 8, 16)},
                  "fa": {"input_buffer": "all"},
                  **{f"s{n}": {"synchronous_steps": n} for n in (75, 150, 300, 450)}}


def recipe_parts(recipe: str) -> tuple[str, list]:
    """("nadam95", ["weight_prediction", "adaptive_momentum"]) for "nadam95+wp+am" (a method with parameters is
    its config object); config suffixes are not part of it (see :func:`config_overrides`)."""
    name, *extras = recipe.split("+")
    known = {**COMPENSATIONS, **CONFIG_SUFFIXES, **PETRA_SUFFIXES}
    if name not in OPTIMIZERS or any(e not in known for e in extras):
        raise SystemExit(f"unknown recipe {recipe!r}: an optimizer {sorted(OPTIMIZERS)} followed by +"
                         f"{'/+'.join(known)} suffixes")
    return name, [COMPENSATIONS[e] for e in extras if e in COMPENSATIONS]


def config_overrides(recipe: str, arm: str = "petra") -> dict:
    """What the recipe's config suffixes set in the DeepSpeed config of ``arm``'s side ({} for none)."""
    out: dict = {}
    for extra in recipe.split("+")[1:]:
        out.update(CONFIG_SUFFIXES.get(extra, {}))
        if arm == "petra" and extra in PETRA_SUFFIXES:
            out.setdefault("petra", {}).update(PETRA_SUFFIXES[extra])
    return out


def backprop_recipe(recipe: str) -> str:
    """The backprop run a PETRA recipe is compared with: its optimizer and config suffixes, no compensation."""
    name, *extras = recipe.split("+")
    return "+".join([name, *(e for e in extras if e in CONFIG_SUFFIXES)])


def stdlib_corpus(out_dir: str, max_chars: int) -> list[str]:
    """train.txt and valid.txt from the standard library's docstrings; returns their paths."""
    paragraphs = []
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.startswith(("test", "site-packages", "idlelib")) or "/test" in rel:
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 4]
        if sum(map(len, paragraphs)) > max_chars:
            break
    split = int(0.95 * len(paragraphs))
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "valid.txt")]
    for path, part in zip(files, (paragraphs[:split], paragraphs[split:])):
        write_text_atomic(path, "\n".join(part) + "\n")
    return files


def run_name(job: dict) -> str:
    depth = "" if job["arm"] == "backprop" else f"-J{job['J']}-k{job['k']}"
    return f"{job['arm']}-{job['recipe']}-lr{job['lr']:g}{depth}-s{job['seed']}-n{job['steps']}"


RUN_NAME = re.compile(r"(?P<arm>backprop|petra)-(?P<recipe>[a-z0-9+]+)-lr(?P<lr>[0-9.e-]+)"
                      r"(-J(?P<J>\d+)-k(?P<k>\d+))?-s(?P<seed>\d+)-n(?P<steps>\d+)$")


def finished_jobs(args: argparse.Namespace) -> list[dict]:
    """Every run under --run-dir that finished (its summary.json exists), as the job that made it."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, args.run_dir, "*", "summary.json"))):
        match = RUN_NAME.match(os.path.basename(os.path.dirname(path)))
        if match:
            g = match.groupdict()
            out.append({"arm": g["arm"], "recipe": g["recipe"], "lr": float(g["lr"]),
                        "J": None if g["J"] is None else int(g["J"]),
                        "k": args.backprop_k if g["k"] is None else int(g["k"]), "seed": int(g["seed"]),
                        "steps": int(g["steps"])})
    return out


def earlier_runs(path: str, known: set[str]) -> list[dict]:
    """The runs an earlier report holds that are not ``known`` (by run name): run directories stay on the
    machine that made them, the report is what the repository keeps."""
    with open(os.path.join(ROOT, path)) as f:
        return [r for r in json.load(f)["runs"] if run_name(r) not in known]


def shipped_config(args: argparse.Namespace, job: dict) -> str:
    """The side's shipped DeepSpeed config (--backprop-config or --petra-config)."""
    return args.backprop_config if job["arm"] == "backprop" else args.petra_config


def config_path(args: argparse.Namespace, job: dict) -> str:
    """The DeepSpeed config a run trains with: the side's shipped one, or, when the recipe has config suffixes,
    the run's own copy of it with them applied (written by :func:`write_config`)."""
    if config_overrides(job["recipe"], job["arm"]):
        return os.path.join(args.run_dir, "configs", f"{run_name(job)}.json")
    return shipped_config(args, job)


def write_config(args: argparse.Namespace, job: dict) -> None:
    """Write the run's own config when its recipe changes the shipped one (before the run, not when it is read
    back)."""
    overrides = config_overrides(job["recipe"], job["arm"])
    if not overrides:
        return
    with open(os.path.join(ROOT, shipped_config(args, job))) as f:
        section = json.load(f)
    petra = {**section.get("petra", {}), **overrides.pop("petra", {})}
    section = {**section, **overrides, **({"petra": petra} if petra else {})}
    path = os.path.join(ROOT, config_path(args, job))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomic(path, json.dumps(section, indent=1))


def command(args: argparse.Namespace, files: list[str], job: dict, out: str) -> list[str]:
    optimizer, compensation = recipe_parts(job["recipe"])
    config = config_path(args, job)
    cmd = launcher(args.procs) + [
        "examples/reformer/train.py", "--deepspeed_config", config, "--model", "revgpt", "--data-files", *files,
        "--seq-len", str(args.seq_len), "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--heads", str(args.heads), "--vocab-size", str(args.vocab_size), "--lr", str(job["lr"]),
        "--warmup-steps", str(max(1, round(args.warmup_frac * job["steps"]))), "--max-steps", str(job["steps"]),
        "--eval-every", str(args.eval_every), "--eval-sequences", str(args.eval_sequences), "--seed", str(job["seed"]),
        "--global-batch", str(args.global_batch), "--micro-batches", str(job["k"]), "--output-dir", out]
    if args.save_every:
        cmd += ["--save-every", str(args.save_every), "--resume", "auto"]
    cmd += ["--optimizer", json.dumps(OPTIMIZERS[optimizer](job["lr"]))]
    if job["arm"] == "petra":
        if not compensation:
            methods = "none"
        elif len(compensation) == 1:
            methods = compensation[0] if isinstance(compensation[0], str) else json.dumps(compensation[0])
        else:
            methods = json.dumps(compensation)
        cmd += ["--stages", str(job["J"]), "--delay-compensation", methods]
        if args.gradient_quality:
            cmd += ["--gradient-quality", str(args.gradient_quality)]
    return cmd


def validated_sequences(summary: dict) -> int:
    """How many held-out sequences a run's validations covered (runs before ``--eval-sequences``: its
    ``--eval-batches`` micro-batches of its micro-batch size)."""
    run_args = summary["args"]
    if run_args.get("eval_sequences") is not None:
        return run_args["eval_sequences"]
    return run_args["eval_batches"] * summary["config"]["train_micro_batch_size_per_gpu"]


def final_loss_on(out: str, summary: dict, sequences: int, text_dir: str) -> float:
    """The mean loss of a finished run's final weights (its checkpoint's "final" tag) on the first
    ``sequences`` held-out sequences of its text (found in ``text_dir``), as the run's own validation computes
    it: for a run whose validation covered other text (before ``--eval-sequences``, the text depended on the
    micro-batch size)."""
    import torch

    from petra_ds.data.text import build_tokenizer, lm_loader, load_text, pack
    from petra_ds.models.causal_lm import RevGPTLMConfig, causal_lm
    from petra_ds.models.transformer import RevGPTConfig, lm_loss

    a = summary["args"]
    files = [os.path.join(ROOT, text_dir, os.path.basename(f)) for f in a["data_files"]]
    tokenizer = build_tokenizer(os.path.join(ROOT, out, f"tokenizer-{a['tokenizer']}-{a['vocab_size']}"))
    blocks = pack(load_text(files, seed=a["seed"])["validation"], tokenizer, a["seq_len"])
    config = RevGPTLMConfig.of(RevGPTConfig(
        vocab_size=len(tokenizer), seq_len=a["seq_len"], d_model=a["d_model"], n_layers=a["layers"],
        n_heads=a["heads"], dropout=a["dropout"], tie_embeddings=a["tie_embeddings"], grain=a.get("grain", "block")))
    model = causal_lm(config, os.path.join(ROOT, out, "checkpoint", "final")).eval()
    batch = 4 if sequences % 4 == 0 else 1  # the protocol's micro-batch: the same sums as its k = 4 runs
    losses = []
    with torch.no_grad():
        for x, y in itertools.islice(lm_loader(blocks, batch, train=False), sequences // batch):
            losses.append(float(lm_loss(model(x).logits, y)))
    return sum(losses) / len(losses)


def run_one(args: argparse.Namespace, files: list[str], job: dict) -> dict:
    out = os.path.join(args.run_dir, run_name(job))
    cmd = command(args, files, job, out)
    if os.path.exists(os.path.join(ROOT, out, "summary.json")):
        (summary, rows), wall = read_run(out), None
    else:
        from petra_ds.tools.run_checkpoints import checkpoint_dir, tags

        write_config(args, job)
        resumed = bool(tags(checkpoint_dir(os.path.join(ROOT, out))))  # what the example's --resume auto reads
        summary, rows, wall = run_example(cmd, out, env={"TORCHDYNAMO_DISABLE": "1"})
        wall = None if resumed else wall  # a continued run's wall time would be its last sitting's
    quality = [r for r in rows if r.get("kind") == "gradient_quality"]
    evals = [r for r in rows if "val_loss" in r]
    seen, final = validated_sequences(summary), summary["final_val_loss"]
    same_text = seen == args.eval_sequences
    if same_text:
        print(f"{run_name(job)}: {final:.4f}", flush=True)
    elif not os.path.isdir(os.path.join(ROOT, out, "checkpoint", "final")):
        final = None  # validated on other text, and its final weights were not kept: it compares with nothing
        print(f"{run_name(job)}: not comparable ({summary['final_val_loss']:.4f} on {seen} other sequences)",
              flush=True)
    else:  # its validations saw other text: only its final weights can be compared
        cached = os.path.join(ROOT, out, f"final_loss_on_{args.eval_sequences}.json")
        if not os.path.exists(cached):
            write_text_atomic(cached, json.dumps(final_loss_on(out, summary, args.eval_sequences,
                                                                 os.path.join(args.run_dir, "text"))))
        with open(cached) as f:
            final = json.load(f)
        print(f"{run_name(job)}: {final:.4f} (revalidated; {summary['final_val_loss']:.4f} on its {seen} sequences)",
              flush=True)
    return {**job, "final_val_loss": final, "val_sequences": seen,
            "revalidated_from": None if same_text else summary["final_val_loss"],
            "best_val_loss": min(r["val_loss"] for r in evals) if same_text else None,
            "val_curve": [(r["step"], r["val_loss"]) for r in evals], "wall_s": wall,
            "gradient_quality": quality, "command": " ".join(cmd[1:] if args.procs > 1 else ["python"] + cmd[1:])}


def jobs(args: argparse.Namespace) -> list[dict]:
    """Backprop once per optimizer the recipes use (or --backprop-optimizers), lr and seed, at --backprop-k
    (its arithmetic does not depend on k); PETRA per recipe, lr, J, k and seed."""
    base = {"steps": args.steps}
    named = args.backprop_optimizers
    optimizers = list(dict.fromkeys([backprop_recipe(r) for r in args.recipes] if named is None else named))
    out = [dict(base, arm="backprop", recipe=o, lr=lr, J=None, k=args.backprop_k, seed=s)
           for o in optimizers for lr in args.lrs for s in args.seeds]
    out += [dict(base, arm="petra", recipe=r, lr=lr, J=J, k=k, seed=s)
            for r in args.recipes for J in args.stages for k in args.k for lr in args.lrs for s in args.seeds]
    return out


def cells(runs: list[dict]) -> dict:
    """{(arm, recipe, J, k, steps): {lr: median final validation loss over seeds, "seeds": n}}."""
    grouped: dict = {}
    for r in (r for r in runs if r["final_val_loss"] is not None):
        grouped.setdefault((r["arm"], r["recipe"], r["J"], r["k"], r["steps"]), {}).setdefault(r["lr"], []).append(
            r["final_val_loss"])
    return {key: {lr: (statistics.median(v), len(v)) for lr, v in by_lr.items()} for key, by_lr in grouped.items()}


def best_against_best(runs: list[dict]) -> list[dict]:
    """Per (J, k, steps): every PETRA recipe's best lr against the best backprop (any optimizer) at the same
    steps, and against backprop with the recipe's own optimizer."""
    table = cells(runs)
    rows = []
    for (arm, recipe, J, k, steps), by_lr in table.items():
        if arm != "petra":
            continue
        lr, (loss, seeds) = min(by_lr.items(), key=lambda item: item[1][0])
        backprop = {key[1]: min(v.items(), key=lambda item: item[1][0]) for key, v in table.items()
                    if key[0] == "backprop" and key[4] == steps}
        if not backprop:
            continue
        best_name, (best_lr, (best_loss, _)) = min(backprop.items(), key=lambda item: item[1][1][0])
        own = backprop.get(backprop_recipe(recipe))
        lrs = sorted(by_lr)
        rows.append({"recipe": recipe, "J": J, "k": k, "steps": steps, "lr": lr, "val_loss": loss, "seeds": seeds,
                     "lr_at_grid_edge": len(lrs) > 1 and lr in (lrs[0], lrs[-1]),
                     "backprop_best": {"optimizer": best_name, "lr": best_lr, "val_loss": best_loss},
                     "gap_to_best_backprop": (loss - best_loss) / best_loss,
                     "gap_to_own_optimizer": None if own is None else (loss - own[1][0]) / own[1][0],
                     "screening": steps < CONFIRM_STEPS,
                     # its final losses come from its final weights: its own validations saw other sequences
                     "revalidated": any(r.get("revalidated_from") is not None for r in runs
                                        if (r["arm"], r["recipe"], r["J"], r["k"], r["steps"], r["lr"])
                                        == (arm, recipe, J, k, steps, lr))})
    return sorted(rows, key=lambda r: (r["steps"], r["J"], r["k"], r["val_loss"]))


def plot(report: dict, path: str) -> None:
    """One panel per (J, k, steps): each recipe's curve at its best lr, backprop's best in black."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["J"], r["k"], r["steps"]) for r in report["best"]})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (J, k, steps) in zip(axes[0], panels):
        rows = [r for r in report["best"] if (r["J"], r["k"], r["steps"]) == (J, k, steps)]
        picks = [("petra", r["recipe"], r["lr"], J, k) for r in rows]
        best = rows[0]["backprop_best"]
        picks.append(("backprop", best["optimizer"], best["lr"], None, report["args"]["backprop_k"]))
        for arm, recipe, lr, depth, kk in picks:
            run = run_of(report, arm, recipe, lr, depth, kk, steps)
            steps_, losses = zip(*run["val_curve"])
            other_text = "" if run.get("revalidated_from") is None else f" (curve: {run['val_sequences']} other seqs)"
            ax.plot(steps_, losses, marker=".", color="black" if arm == "backprop" else None,
                    label=f"{'backprop ' if arm == 'backprop' else ''}{recipe} lr {lr:g}{other_text}")
        loss_panel(ax, f"J = {J}, k = {k}, {steps} steps")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run_of(report: dict, arm: str, recipe: str, lr: float, J: int | None, k: int, steps: int) -> dict | None:
    """The report's first run (the first seed) of that arm, recipe, lr, J, k and length; None when it has none."""
    key = (arm, recipe, lr, J, k, steps)
    return next((r for r in report["runs"] if (r["arm"], r["recipe"], r["lr"], r["J"], r["k"], r["steps"]) == key),
                None)


def loss_panel(ax, title: str) -> None:
    """A validation-loss panel's title, axes, grid and legend."""
    ax.set_title(title)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=["adamw+wp", "nadam95", "nadam95+wp", "muon", "muon+wp"],
                        help="PETRA methods: optimizer[+wp][+am][+lr]...[+nc][+f2] (weight prediction, adaptive "
                             "momentum, lr rescaling, ...; nc: no gradient clipping; fN, N in 1, 2, 4, 8, 16: stages "
                             "1..N keep their inputs; fa: every stage does; the flag alone: no PETRA run, only "
                             "--backprop-optimizers' runs)")
    parser.add_argument("--backprop-optimizers", nargs="*", default=None,
                        help="backprop's optimizers, optimizer[+nc] (default: those the recipes use; the flag alone: "
                             "no backprop run, the --earlier report's serve)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3])
    parser.add_argument("--stages", type=int, nargs="+", default=[4], help="PETRA depths J")
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="micro-batches per step (global batch fixed)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--backprop-k", type=int, default=4, help="backprop's micro-batches per step")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup-frac", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--procs", type=int, default=1, help="processes per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--eval-sequences", type=int, default=120,
                        help="held-out sequences per validation, the same for every k (a multiple of every micro-batch)")
    parser.add_argument("--gradient-quality", type=int, default=0, metavar="N",
                        help="PETRA runs record the gradient-quality study every N steps")
    parser.add_argument("--max-chars", type=int, default=3_000_000)
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="runs checkpoint every N steps and continue from their latest checkpoint when started "
                             "again (a run longer than one sitting: stop it, run the same command later)")
    parser.add_argument("--petra-config", default="ds_configs/petra_lm.json")
    parser.add_argument("--backprop-config", default="ds_configs/backprop_lm.json")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing, only report (every invocation reports every finished run under --run-dir)")
    parser.add_argument("--earlier", metavar="REPORT", default=None,
                        help="an earlier report's JSON: its runs that are not under --run-dir join this report")
    parser.add_argument("--output", default="runs/lm_accuracy/report.json")
    parser.add_argument("--run-dir", default="runs/lm_accuracy")
    args = parser.parse_args(argv)
    for flag, k in [("--backprop-k", args.backprop_k)] + [("--k", k) for k in args.k]:
        if args.global_batch % k:
            parser.error(f"{flag} {k} does not divide --global-batch {args.global_batch}: every run takes the same "
                         f"sequences per step in k equal micro-batches; pick a divisor of {args.global_batch}")
    for recipe in args.recipes:
        recipe_parts(recipe)
    for recipe in args.backprop_optimizers or []:
        if recipe_parts(recipe)[1]:
            raise SystemExit(f"--backprop-optimizers {recipe}: backprop has no delay compensation; give "
                             f"{backprop_recipe(recipe)}")

    files = stdlib_corpus(os.path.join(ROOT, args.run_dir, "text"), args.max_chars)
    todo = [] if args.report_only else jobs(args)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run_one(args, files, job), todo))
    # one table over the whole sweep: every finished run of earlier invocations, read back
    mine = {run_name(r) for r in runs}
    runs += [run_one(args, files, job) for job in finished_jobs(args) if run_name(job) not in mine]
    if args.earlier:
        runs += earlier_runs(args.earlier, {run_name(r) for r in runs})  # a run read back here wins
    backprop = [{"optimizer": recipe, "steps": steps, "lr": min(by_lr, key=lambda lr: by_lr[lr][0]),
                 "val_loss": min(v[0] for v in by_lr.values()), "lrs": sorted(by_lr)}
                for (arm, recipe, _, _, steps), by_lr in sorted(cells(runs).items(), key=str) if arm == "backprop"]
    report = {"model": "revgpt", "args": vars(args), "runs": runs, "backprop": backprop,
              "best": best_against_best(runs)}
    save_report(args.output, report)
    plot(report, os.path.join(ROOT, os.path.splitext(args.output)[0] + ".png"))
    for b in backprop:
        print(f"backprop {b['optimizer']:8s} {b['steps']:5d} steps: best lr {b['lr']:g} of {b['lrs']}, "
              f"val loss {b['val_loss']:.4f}")
    print(f"{'steps':>5s} {'J':>2s} {'k':>3s} {'recipe':16s} {'lr':>7s} {'val loss':>9s} {'vs best backprop':>17s} "
          f"{'vs own optimizer':>17s}")
    for r in report["best"]:
        own = r["gap_to_own_optimizer"]
        print(f"{r['steps']:5d} {r['J']:2d} {r['k']:3d} {r['recipe']:16s} {r['lr']:7.0e} {r['val_loss']:9.4f} "
              f"{100 * r['gap_to_best_backprop']:+16.2f}% {'' if own is None else f'{100 * own:+.2f}%':>17s}"
              f"{'  (lr at grid edge)' if r['lr_at_grid_edge'] else ''}{'  screening' if r['screening'] else ''}"
              f"{'  revalidated' if r['revalidated'] else ''}")

