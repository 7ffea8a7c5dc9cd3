from quantkit.cli.main import main

main()
