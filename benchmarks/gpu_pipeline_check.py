"""One PPO iteration of the (shrunk) tiny default on a CUDA GPU, every stage as a plain process.

Why: the CPU suite runs every stage on CPU; this runs the same stage commands (from dvc.yaml, no
DVC needed) with every torch stage on ``cuda`` in bf16 where the stage allows it, PPO with the
critic and the Bradley-Terry reward model as the reward, so the GPU code paths of generate
(HF engine), train_reward_model, score (batch reward), reference_logprob (packed varlen
attention), values, train (actor + critic, packed micro-batches) and evaluate run end to end.

    python benchmarks/gpu_pipeline_check.py --workdir /tmp/gpu-check

Prints each stage's wall time and headline metrics; exits non-zero if a stage fails.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlpipe.run.commands import stage_commands  # noqa: E402

SHRINK = {"prepare": {"tiny": {"num_train": 400, "num_eval": 64, "warmstart_steps": 200, "num_preference_pairs": 400}},
          "generate": {"prompts_per_iteration": 64, "group_size": 8}}
CUDA = {"generate": {"device": "cuda", "dtype": "bfloat16", "engine": "hf"},
        "reference_logprob": {"device": "cuda", "dtype": "bfloat16"},
        "values": {"device": "cuda", "dtype": "bfloat16"},
        "train": {"device": "cuda", "dtype": "bfloat16", "minibatch_size": 128, "micro_batch_size": 64},
        "reward_model": {"device": "cuda", "dtype": "bfloat16"},
        "evaluate": {"device": "cuda", "dtype": "bfloat16"},
        "advantage": {"estimator": "gae"}}
REWARDS = [{"name": "reward_model", "weight": 1.0,
            "options": {"path": "artifacts/train_reward_model/model", "device": "cuda", "dtype": "bfloat16",
                        "max_tokens_per_batch": 16384}},
           {"name": "exact_answer", "weight": 0.0,
            "options": {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}}]


def merge(base: dict, over: dict) -> dict:
    for key, value in over.items():
        base[key] = merge(base[key], value) if isinstance(value, dict) else value
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--device", default="cuda", help="cpu: the same run on CPU in float32 (to check the script)")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(REPO / "stages", work / "stages")
    on_device = CUDA if args.device == "cuda" else json.loads(
        json.dumps(CUDA).replace('"cuda"', '"cpu"').replace('"bfloat16"', '"float32"'))
    rewards = REWARDS if args.device == "cuda" else json.loads(
        json.dumps(REWARDS).replace('"cuda"', '"cpu"').replace('"bfloat16"', '"float32"'))
    params = merge(merge(yaml.safe_load((REPO / "params.yaml").read_text()), SHRINK), on_device)
    params["score"]["rewards"] = rewards
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    failed = False
    for name, cmd in stage_commands(REPO / "dvc.yaml", work / "params.yaml").items():
        start = time.time()
        proc = subprocess.run(shlex.split(cmd), cwd=work, capture_output=True, text=True)
        seconds = time.time() - start
        summary = ((proc.stderr + proc.stdout).strip().splitlines() or [""])[-1]
        print(f"{name:20s} {seconds:6.1f} s  rc={proc.returncode}  {summary}", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], flush=True)
            failed = True
            break
    if not failed:
        train = json.loads((work / "metrics/train.json").read_text())
        keys = ("optimizer_steps", "value_loss", "explained_variance", "clip_fraction", "approx_kl_old",
                "sampler_mismatch_mean_abs", "sampler_mismatch_max_abs")
        print(json.dumps({k: train.get(k) for k in keys}, indent=1))
        print(json.dumps({k: v for k, v in json.loads((work / "metrics/evaluate.json").read_text()).items()
                          if k in ("accuracy", "reward_mean")}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
