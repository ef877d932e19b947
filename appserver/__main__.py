from appserver.cli.main import main

main()
