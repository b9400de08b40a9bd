pytest_plugins = ["harness.plugin", "fsdptest.plugin", "upstream.plugin", "pytester"]
