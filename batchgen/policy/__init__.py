"""Scheduling policies: state in, decisions out, no torch and no Dask.

The runtime, the Dask plugin and the simulator drive the same functions (tests/test_layers.py
keeps this package free of torch and Dask):

    balance          which coroutines move between workers (the scheduler plugin, sim)
    speed            an engine's measured speed (the runner, sim)
    length_prediction  output lengths learned from finished rows, per group and given a row's age
                     (the engine's length-aware admission, sim)
    placement        models and rows onto workers (multi-model and MoA jobs, sim)
    expert_eviction  which experts the offload tiers keep
    diffusion_cost   a denoising forward's seconds; diffusion_step: which trajectories step
                     together; diffusion_plan / diffusion_steal: the elastic degree and handovers

The engine's own scheduler (admission, eviction, batching) is runtime/policy.py, beside the
sequence and KV state it plans over (its admission orders: runtime/prefix_order.py and
runtime/length_order.py).
"""
