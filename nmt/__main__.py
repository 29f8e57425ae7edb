from nmt.cli import main

main()
