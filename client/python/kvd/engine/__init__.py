"""The smallest honest engine on kvd's memory: a decoder-only transformer (model.py) whose paged
KV cache is kvd's slabs (paged_kv.py), driven through kvd's protocol (engine.py), wrapped in a
worker process (worker.py: python3 -m kvd.engine.worker). It is the reference integration and the
end-to-end proof that reuse is exact (tests/python/test_engine.py; docs/integration.md).

hybrid_model.py is the reference hybrid model (full, sliding-window and recurrent layers; KV
groups behind HybridKv) and hybrid_cache.py an in-process simulator of the hybrid prefix cache
that proves its reuse exact (tests/python/test_hybrid_model.py; docs/hybrid.md §2.10);
hybrid_batch.py runs it in a continuous batch with every KV group in kvd's memory
(tests/python/test_hybrid_engine.py)."""
