"""The device: moving host lists to it and results back without stalling it, CUDA streams by lane
priority, and whether a failed forward left it unusable.
"""
