"""Serving: the async engine front (``async_llm``), the OpenAI-compatible HTTP server
(``openai_server``), its metrics (``metrics``) and the serving benchmark client
(``bench_serve``)."""
