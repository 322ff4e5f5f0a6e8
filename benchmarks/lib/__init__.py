"""The benchmarks' harness; the scripts in benchmarks/ are thin over it.

    cluster.py  Ray + Serve, deploy an app and wait, replica logs, GPU memory, machine and commit
    apps.py     an app's config (a mode on one GPU), deploy, run a list of loads, delete
    loads.py    loads, warm-up and mixed traffic, time estimates, the decode stall
    results.py  a row per point, Markdown tables, goals, goodput, plots, the scripts' shared flags
    pairs.py    the constructed pair saved once and checked; timelines.py the lanes' timelines read
    goals.py, mps.py, proc_cpu.py, engine_runs.py: lanes_1gpu's verdicts, the MPS daemon, cores per
    serving process, random token-id workloads
"""
