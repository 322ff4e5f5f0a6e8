"""The benchmarks' harness; the scripts in benchmarks/ are thin over it.

    cluster.py      Ray + Serve up, deploy an app and wait, replica logs, GPU memory, machine and commit
    pairs.py        the constructed model pair saved to disk once, reloaded and checked
    apps.py         an app's config (a mode on one GPU), deploy, a list of loads (each with a sampler
                    beside it, if asked), delete; PRESETS
    loads.py        loads (requests, arrivals, request options), the warm-up burst, mixed traffic, time
                    estimates, the decode stall, requests in flight over time
    results.py      a row per point, Markdown tables, ratios against goals, goodput under latency bounds,
                    plots, files rewritten after every point; the flags the scripts share
    engine_runs.py  the co-located engine of an app config in process, and a closed loop over its steps
    proc_cpu.py     the cores each serving process used over a point (which hop is busy)
    timelines.py    the lanes' timelines read: busy time, verify against drafting, the prefill path
    goals.py, mps.py, traces.py   lanes_1gpu.py's verdicts, MPS daemon, decode-step traces
"""
