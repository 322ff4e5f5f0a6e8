"""The decode loop and what surrounds it: the engine core and its step, the scheduler, the host-side
state of a request, the outputs it streams, the seams to the other lanes, the async front and the
engine process.
"""
