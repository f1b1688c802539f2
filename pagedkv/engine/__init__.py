"""Engine: drivers on top of the index layer.

* ``llm_engine.LLMEngine``: a real model (scheduler + ``ModelRunner`` + output processing);
* ``llm.LLM``: the user API (``generate``), shaped like vLLM's.

The index-layer driver of ``pagedkv trace``, workloads, benchmarks and the demo live in
``pagedkv.tools``.
"""
