"""Everything a person runs: the ``kvwire`` CLI (``cli`` wires each module's subcommands),
the demo, every benchmark and the fuzzer. The library never imports from here."""
