"""The ``flexcomm-train`` app: data-parallel training over a (possibly emulated, slow) network.

Modules, in the order a run meets them:

* :mod:`~flexcomm.train.cli` -- options, validation before any rank starts, the demo defaults;
* :mod:`~flexcomm.train.arg_types` -- the options' value types (each names the rule a value broke);
* :mod:`~flexcomm.train.config` -- the run's settings, shared by launcher and ranks via ``config.json``;
* :mod:`~flexcomm.train.job` -- one job: its ranks (through :mod:`flexcomm.launch`), its network, who failed;
* :mod:`~flexcomm.train.worker` -- one rank: model, data, DDP with the comm hook, the training loop;
* :mod:`~flexcomm.train.timed_hook` -- flexcomm's hook or a baseline, timed per step;
* :mod:`~flexcomm.train.baselines` -- PyTorch's PowerSGD and fp16 hooks (one DDP bucket for PowerSGD on gloo);
* :mod:`~flexcomm.train.rank_data` -- what each rank trains on: data set, its partition, batch order;
* :mod:`~flexcomm.train.checkpoint` -- per-rank atomic checkpoints and exact resume;
* :mod:`~flexcomm.train.records` -- ``records.jsonl`` and ``summary.json``;
* :mod:`~flexcomm.train.report` -- ``flexcomm-report``: plots and a Markdown table;
* :mod:`~flexcomm.train.demo` -- ``flexcomm-demo``: dense DDP and flexcomm side by side on a changing link;
* :mod:`~flexcomm.train.models` -- the models;
* :mod:`~flexcomm.train.datasets` -- data sources (IDX, npz, image folders, synthetic) and tensors;
* :mod:`~flexcomm.train.partition` -- splitting samples among ranks (IID, Dirichlet).
"""
