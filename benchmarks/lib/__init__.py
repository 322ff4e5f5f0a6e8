"""The benchmarks' shared harness: cluster.py (Ray, Serve, deploy, replica logs, the machine), apps.py (an app's
config and its run of loads), loads.py (what is sent, how long it takes), results.py (rows, tables, goodput, plots,
shared flags), pairs.py (the saved constructed pair), timelines.py (the lanes' timelines read), goals.py
(lanes_1gpu's verdicts), mps.py (the MPS daemon), proc_cpu.py (cores per serving process)."""
