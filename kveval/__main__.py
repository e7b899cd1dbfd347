from kveval.cli import main

main()
