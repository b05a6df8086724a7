"""Layer `safety`: what keeps a step's promise, that it changes nothing unless it completes and runs as the caller
would alone.

`transaction`: gradients and buffers set aside, merged on success, restored on any error; `tree`: the model's
modules and parameters, each once; `rng`: each micro-batch's random stream, the caller's generators one draw
on; `interrupts`: Ctrl-C taken at the step's safe points; `threadstate` and `flags`: torch's per-thread state and
process-wide flags, swapped as the micro-batches take turns; `graphs`: the K graphs checked before their
backward (no micro-batch uses another's tensors, no batch norm ran unseen); `untraced`: the engine's code that
torch.compile runs as it is (a graph break at each BatchNorm call) and never compiles; `shared`: a process-wide
setting changed while steps run on any thread; `attributes`: the modules' attributes as the step found them, for
each run of a forward again.

Imports: torch only; no other layer of the engine.
"""
