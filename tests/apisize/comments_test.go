package main

import "testing"

func TestCodeLines(t *testing.T) {
	for _, tc := range []struct {
		name        string
		src         string
		lines, code int
	}{
		{"empty", "", 0, 0},
		{"package only", "package p\n", 1, 1},
		{"comments and blanks", "// Package p.\n\n/*\nmore\n*/\npackage p\n\n", 7, 1},
		{"trailing comment is code", "package p\n\nvar x = 1 // one\n", 3, 2},
		{"raw string spans its lines", "package p\n\nvar s = `a\n\nb`\n", 5, 4},
		{"no final newline", "package p\n// c", 2, 1},
	} {
		lines, code := codeLines([]byte(tc.src))
		if lines != tc.lines || code != tc.code {
			t.Errorf("%s: codeLines = %d lines, %d code; want %d, %d", tc.name, lines, code, tc.lines, tc.code)
		}
	}
}
