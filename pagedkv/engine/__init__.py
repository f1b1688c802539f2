"""Engine: drivers on top of the index layer.

* ``index_driver.IndexLayerDriver``: the index layer with a fake model (``pagedkv trace``);
* ``llm_engine.LLMEngine``: a real model (scheduler + ``ModelRunner`` + output processing);
* ``llm.LLM``: the user API (``generate``), shaped like vLLM's.
"""
