"""The learning algorithm's plug-ins: policy losses and off-policy correction
(`losses`, `correction`; torch, used by the trainer) and advantage estimators
(`advantages`; plain Python, used where a group is scored). Each is resolved by
registered name through reflow.core.plugins, never by a path a spec names."""
