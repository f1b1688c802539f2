"""Tools around the engine, not the engine itself: the index-layer driver with a fake model
(``index_driver``, what ``pagedkv trace`` runs), synthetic workloads (``workload``), the
throughput benchmark (``benchmark``), the real-model demo (``demo``) and the trace page
(``trace_html``)."""
