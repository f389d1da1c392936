"""DVC stage `reference_logprob`: per-token log-probs of the completions under the reference policy.

    python stages/reference_logprob.py --params params.yaml --rollouts R.parquet --reference MODEL_DIR \
        --out ref_logprobs.parquet --metrics metrics/reference_logprob.json

Data parallel on several GPUs (each rank scores a share of the batches; byte-identical output):

    torchrun --standalone --nproc_per_node 2 stages/reference_logprob.py ...

The logic is rlpipe/stages/reference_logprob.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import REF_LOGPROBS, ROLLOUTS
from rlpipe.distributed import finish, start
from rlpipe.engines.logprobs import compile_decoder_layers, compile_layers_wanted, compile_seconds
from rlpipe.models.loading import load_model, load_tokenizer, setup_torch
from rlpipe.progress import stage_progress
from rlpipe.stages.reference_logprob import reference_metrics, reference_table

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("reference_logprob")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table (generate's output)"),
         reference: str = typer.Option(..., help="model directory of the reference policy"),
         out: str = typer.Option(..., help="reference log-prob table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.reference_logprob
        dist = start(cfg.device)  # None unless launched by torchrun
        setup_torch(p.torch_threads, 0)
    with timer.phase("read"):
        roll = read_artifact(rollouts, ROLLOUTS)
        pad_id = load_tokenizer(reference).pad_token_id
        model = load_model(reference, device=cfg.device, dtype=cfg.dtype)
        compiled = compile_layers_wanted(cfg.compile_layers, cfg.device)
        if compiled:
            compile_decoder_layers(model)
    with timer.phase("compute"):
        with stage_progress("reference_logprob", total=roll.frame.height, unit="sequences") as advance:
            ref = reference_table(model, roll.frame, cfg, temperature=p.generate.temperature, pad_token_id=pad_id,
                                  reference_version=p.reference.version, dist=dist, progress=advance)
    timer.move(compile_seconds(), to="compile")
    finish(dist)
    if ref is None:  # under torchrun, ranks other than 0 write nothing
        return
    with timer.phase("write"):
        write_artifact(ref, out, REF_LOGPROBS, metadata={"reference_version": p.reference.version,
                                                          "policy_version": roll.metadata.get("policy_version")})
    m = {**reference_metrics(ref, roll.frame), "compiled_layers": compiled}
    stage.write_metrics(metrics, "reference_logprob", m, timer)
    stage.summary_line("reference_logprob", rows=m["num_samples"], tokens=m["tokens"],
                       seconds=timer.report()["total"], kl_sampler_ref=round(m["kl_sampler_ref_k1"], 4))


if __name__ == "__main__":
    stage.run(app)
