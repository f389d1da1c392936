"""Warm processes that take the fixed cost out of an iteration, without changing what any stage computes.

Two long-lived servers, both optional, both started and stopped by ``rlpipe run`` (or by hand with
``rlpipe worker start|stop|status``):

- the **stage server** (`stage_server`): a process that has imported torch, transformers, polars
  and pyarrow once and forks a child per stage command. A stage script started by DVC finds it
  (`stage_client`, called first thing by ``rlpipe.stages.runner``), hands over its arguments, working
  directory, environment and standard streams, and exits with the child's exit code. The child
  re-imports every rlpipe module from disk, so a stage's result depends on exactly what it does
  without the server: DVC's caching and the byte-identical outputs are unchanged.
- the **engine server** (`engine_server`): a generation engine (vLLM on a GPU; the HF engine for
  tests) that outlives a stage. `engine_client.RemoteEngine` implements
  `rlpipe.engines.base.GenerationEngine` against it; before each request the server reloads the
  weights when the policy directory changed, so a generate or evaluate stage pays weight loading,
  never engine start, compilation and CUDA-graph capture again.

What this package may import: the standard library, ``rlpipe.errors``, ``rlpipe.engines`` and
``rlpipe.models`` (engine server only). `stage_client` imports the standard library alone: it runs
before anything heavy in every stage process.
"""
