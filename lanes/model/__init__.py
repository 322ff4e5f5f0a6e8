"""The models: loading and checking the pair, which families run exactly, the runner of one batched
forward over the KV pool, the fused decoder and its kernels, attention, CUDA graphs.
"""
