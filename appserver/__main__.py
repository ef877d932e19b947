from appserver.cli.main import run

run()
