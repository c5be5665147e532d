package main

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/scanner"
	"go/token"
	"io"
	"os"
)

// lineCount is how a package's non-test, non-generated files split into
// lines: all of them, and those with no code (comment lines and blank
// lines).
type lineCount struct {
	dir          string
	lines, prose int
}

// percent is prose as a percentage of lines, 0 for no lines.
func (c lineCount) percent() float64 {
	if c.lines == 0 {
		return 0
	}
	return 100 * float64(c.prose) / float64(c.lines)
}

// countLines splits the lines of src's non-generated files into code and
// prose: a line holds code if a token other than a comment starts on it or
// spans it (a raw string); every other line is a comment or blank.
func (src *source) countLines() (lineCount, error) {
	c := lineCount{dir: src.dir}
	for i, f := range src.files {
		if ast.IsGenerated(f) {
			continue
		}
		b, err := os.ReadFile(src.paths[i])
		if err != nil {
			return c, err
		}
		lines, code := codeLines(b)
		c.lines += lines
		c.prose += lines - code
	}
	return c, nil
}

// codeLines counts the lines of a Go file and those that hold code.
func codeLines(b []byte) (lines, code int) {
	fset := token.NewFileSet()
	file := fset.AddFile("", fset.Base(), len(b))
	var s scanner.Scanner
	s.Init(file, b, nil, 0) // comments are skipped
	hasCode := map[int]bool{}
	for {
		pos, tok, lit := s.Scan()
		if tok == token.EOF {
			break
		}
		if tok == token.SEMICOLON && lit == "\n" {
			continue // inserted at a line's end, not written
		}
		first := file.Line(pos)
		last := file.Line(pos + token.Pos(len(lit)))
		if lit == "" {
			last = first
		}
		for l := first; l <= last; l++ {
			hasCode[l] = true
		}
	}
	lines = bytes.Count(b, []byte("\n"))
	if len(b) > 0 && b[len(b)-1] != '\n' {
		lines++ // the last line has no newline
	}
	return lines, len(hasCode)
}

// proseShare counts the lines of every published package that size counts
// (not generated, not tests).
func proseShare(sources []*source) ([]lineCount, error) {
	var counts []lineCount
	for _, src := range sources {
		c, err := src.countLines()
		if err != nil {
			return nil, err
		}
		if c.lines > 0 {
			counts = append(counts, c)
		}
	}
	return counts, nil
}

// printProse writes each package's comment and blank lines against all its
// lines, and the total.
func printProse(w io.Writer, counts []lineCount) (total lineCount) {
	fmt.Fprintf(w, "comment and blank lines of the published packages' non-test, non-generated .go files\n")
	fmt.Fprintf(w, "  %-16s %6s %6s %6s\n", "package", "lines", "prose", "%")
	for _, c := range counts {
		fmt.Fprintf(w, "  %-16s %6d %6d %5.1f%%\n", c.dir, c.lines, c.prose, c.percent())
		total.lines += c.lines
		total.prose += c.prose
	}
	fmt.Fprintf(w, "total %d lines, %d comment or blank: %.1f%%\n", total.lines, total.prose, total.percent())
	return total
}
