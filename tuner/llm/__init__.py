"""Tune a model, not a shape: ``python -m tuner model=llama-3.1-8b``.

A model's attention geometry (``attention``: heads, KV heads, head_dim, each layer's
window, softcap, sinks, softmax scale), read from a ``tuner/conf/model/`` option or
any Hugging Face ``config.json`` (``hf_config``), times the serving buckets
(``problems``: prefill lengths, decode batch x KV length) gives the distinct attention
problems the model runs, each with the layers and buckets it serves. The planner says
which of them can be served (``servable``); ``run`` tunes the others one after another
through ``tuner.app``'s per-problem tuning and ``summary`` prints one table of them.
"""
