module ucm/e2e/tools/upstream-keys

go 1.26.0

require filippo.io/keygen v1.0.0

require (
	filippo.io/bigmod v0.1.1-0.20260103110540-f8a47775ebe5 // indirect
	golang.org/x/sys v0.36.0 // indirect
)
