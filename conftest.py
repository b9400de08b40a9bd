pytest_plugins = ["harness.plugin", "fsdptest.plugin", "pytester"]
