"""Layer `intercept`: every normalization call of a step that couples a batch's samples, found and handed to the
schedule; and what cannot be found, refused.

`calls`: the TorchFunctionMode that routes each batch-statistics norm call to its schedule (`NormCalls`);
`forwards`: the forwards torch's own layers get for a step, which spare them the mode's cost; `higher_order`: the
higher-order ops whose bodies dynamo traces out of the mode's sight, made plain calls or refused; `hidden`: the
batch-norm ops below F.batch_norm, refused where the mode sees them; `torchs`: whether a function is torch's own
code or a library's replacement; `guards`: the layers and hooks no mode can see or make exact, refused before the
step.

Imports: the layers below (`bn`, `safety`, `memory`).
"""
