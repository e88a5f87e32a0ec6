"""Which kernels a call launched: for the tests that check the dispatch's choice on the device."""


def record_launches(monkeypatch, module):
    """A list that receives the expression of every spec `module.get_function` is asked for."""
    launched = []
    real = module.get_function

    def recording(spec):
        launched.append(spec.expression)
        return real(spec)

    monkeypatch.setattr(module, "get_function", recording)
    return launched
