// Command apisize prints the size of idemkey's public API, so that make lint
// shows it and a limit can hold it down. It reads source only (go/parser, no
// type checking), from the repository root given by -root:
//
//	go run ./tests/apisize -root . [-max-total N] [-max-entry N] [-max-reexport N] [-max-shared N] [-max-prose-percent P]
//
// The rules:
//
//   - Published packages: every package in the modules that scripts/release
//     publishes (its published=(...) line), except those under an internal/
//     directory, main packages (cmd/), testdata, and directories of another
//     module. A package whose files are all generated (proto/) counts nothing
//     and is left out.
//   - Files: not _test.go, and not generated (the standard "// Code
//     generated ... DO NOT EDIT." line before the package clause).
//   - A name: an exported top-level func, type, const or var, or an exported
//     method (a func declaration) of an exported type. Struct fields,
//     interface methods and methods promoted from an embedded type do not
//     count.
//   - Entry packages: interceptor, idemhttp, idemconnect, consumer.
//   - Kit packages: protokey/rpckit, the kit the gRPC and Connect adapters
//     are built from. It is published only because idemconnect, a module
//     of its own, imports it (a module imports none of another's internal
//     packages: scripts/check-deps), and its doc says an application needs
//     none of it; so its names are printed on a line of their own and are
//     in no other figure (total, shared), as an internal package's are not.
//   - A re-export: an exported name that only passes on another package's: a
//     type alias of pkg.Y (pkg.Y[T] too); a const or var whose value is pkg.Y
//     or a conversion T(pkg.Y); a func whose body is one return of a call to
//     pkg.F, or of a local call with that call as its one argument
//     (return withEngine(engine.WithTenant(f))). pkg is an import of another
//     published package, not shadowed by the func's parameters: wrapping the
//     standard library or a dependency (time.Minute, context.WithValue) or
//     exposing an internal package's name is not a re-export. Methods never
//     are.
//   - Shared names: a top-level name (not a method) exported by two or more
//     published packages.
//   - Prose: the comment and blank lines of the published packages' counted
//     files (a line holds code if a token other than a comment is on it),
//     as a share of all their lines; -max-prose-percent limits it.
//
// Each -max flag is off at 0; over a limit, a line on stderr says which and
// the exit status is 1 (2 if the source cannot be read). -max-reexport limits
// the re-exports of all published packages, not only the entry packages'.
package main

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
)

// entryPackages are the packages an application starts from, as directories
// from the repository root.
var entryPackages = []string{"interceptor", "idemhttp", "idemconnect", "consumer"}

// kitPackages are the published packages that are the adapters' kit, not
// the API an application reads, as directories from the repository root.
var kitPackages = []string{"protokey/rpckit"}

// limits are the -max flags; 0 is no limit.
type limits struct {
	total, entry, reexport, shared int
}

func main() {
	root := flag.String("root", ".", "the repository root")
	var lim limits
	flag.IntVar(&lim.total, "max-total", 0, "the most names all published packages may export (0: no limit)")
	flag.IntVar(&lim.entry, "max-entry", 0, "the most names the entry packages may export (0: no limit)")
	flag.IntVar(&lim.reexport, "max-reexport", 0, "the most re-exports all published packages may have (0: no limit)")
	flag.IntVar(&lim.shared, "max-shared", 0, "the most names that may be exported by more than one package (0: no limit)")
	maxProse := flag.Float64("max-prose-percent", 0, "the highest share, in percent, of comment and blank lines in the published packages' non-test, non-generated .go files (0: no limit)")
	flag.Parse()
	api, err := measure(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apisize:", err)
		os.Exit(2)
	}
	api.print(os.Stdout)
	over := api.overLimits(lim)
	sources, err := readPackages(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apisize:", err)
		os.Exit(2)
	}
	counts, err := proseShare(sources)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apisize:", err)
		os.Exit(2)
	}
	if total := printProse(os.Stdout, counts); *maxProse > 0 && total.percent() > *maxProse {
		over = append(over, fmt.Sprintf("comment and blank lines: %.1f%% of %d lines, over the limit of %g%% (-max-prose-percent)", total.percent(), total.lines, *maxProse))
	}
	if len(over) > 0 {
		for _, line := range over {
			fmt.Fprintln(os.Stderr, "apisize:", line)
		}
		os.Exit(1)
	}
}

// pkgSize is what one package exports.
type pkgSize struct {
	dir                                 string // from the repository root, "." for the root
	funcs, types, consts, vars, methods int
	reexported                          []string // the names that are re-exports
	topLevel                            []string // the exported top-level names
}

func (p *pkgSize) names() int { return p.funcs + p.types + p.consts + p.vars + p.methods }

// apiSize is what the published packages export, by package in path order.
type apiSize struct {
	packages []*pkgSize
	// shared maps each top-level name exported by more than one package to
	// those packages.
	shared map[string][]string
}

func (a *apiSize) total() (names, reexports int) {
	for _, p := range a.packages {
		if slices.Contains(kitPackages, p.dir) {
			continue
		}
		names += p.names()
		reexports += len(p.reexported)
	}
	return names, reexports
}

func (a *apiSize) entry() (names, reexports int) {
	for _, p := range a.packages {
		if slices.Contains(entryPackages, p.dir) {
			names += p.names()
			reexports += len(p.reexported)
		}
	}
	return names, reexports
}

func (a *apiSize) pkg(dir string) *pkgSize {
	for _, p := range a.packages {
		if p.dir == dir {
			return p
		}
	}
	return nil
}

func (a *apiSize) print(w io.Writer) {
	fmt.Fprintf(w, "apisize: the exported names of %d published packages (rules: go doc ./tests/apisize)\n", len(a.packages))
	fmt.Fprintf(w, "  %-16s %5s %5s %5s %5s %5s %6s %9s\n", "package", "names", "func", "type", "const", "var", "method", "re-export")
	for _, p := range a.packages {
		fmt.Fprintf(w, "  %-16s %5d %5d %5d %5d %5d %6d %9d\n", p.dir, p.names(), p.funcs, p.types, p.consts, p.vars, p.methods, len(p.reexported))
	}
	names, reexports := a.total()
	entryNames, entryReexports := a.entry()
	fmt.Fprintf(w, "total %d names, %d re-exports; entry packages (%s) %d names, %d re-exports\n",
		names, reexports, strings.Join(entryPackages, " "), entryNames, entryReexports)
	for _, p := range a.packages {
		if slices.Contains(kitPackages, p.dir) {
			fmt.Fprintf(w, "the adapters' kit %s: %d names, in no other figure\n", p.dir, p.names())
		}
	}
	fmt.Fprintf(w, "names in more than one package: %d\n", len(a.shared))
	writeWrapped(w, "  ", a.sharedList(), 100)
}

// sharedList is the shared names, each with how many packages export it,
// the most shared first.
func (a *apiSize) sharedList() []string {
	names := make([]string, 0, len(a.shared))
	for name := range a.shared {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool {
		ni, nj := len(a.shared[names[i]]), len(a.shared[names[j]])
		if ni != nj {
			return ni > nj
		}
		return names[i] < names[j]
	})
	for i, name := range names {
		names[i] = fmt.Sprintf("%s(%d)", name, len(a.shared[name]))
	}
	return names
}

// writeWrapped writes words separated by spaces, in lines of at most width
// characters after indent.
func writeWrapped(w io.Writer, indent string, words []string, width int) {
	line := ""
	for _, word := range words {
		if line != "" && len(line)+1+len(word) > width {
			fmt.Fprintln(w, indent+line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += word
	}
	if line != "" {
		fmt.Fprintln(w, indent+line)
	}
}

// overLimits says which figures are over their limits.
func (a *apiSize) overLimits(lim limits) []string {
	names, reexports := a.total()
	entryNames, _ := a.entry()
	var over []string
	check := func(figure, limit int, what, flagName string) {
		if limit > 0 && figure > limit {
			over = append(over, fmt.Sprintf("%s: %d, over the limit of %d (%s)", what, figure, limit, flagName))
		}
	}
	check(names, lim.total, "names of all published packages", "-max-total")
	check(entryNames, lim.entry, "names of the entry packages", "-max-entry")
	check(reexports, lim.reexport, "re-exports of all published packages", "-max-reexport")
	check(len(a.shared), lim.shared, "names in more than one package", "-max-shared")
	return over
}

// measure reads the published packages under root.
func measure(root string) (*apiSize, error) {
	sources, err := readPackages(root)
	if err != nil {
		return nil, err
	}
	published := map[string]string{} // import path to package name
	for _, src := range sources {
		published[src.importPath] = src.name
	}
	api := &apiSize{shared: map[string][]string{}}
	for _, src := range sources {
		if p := src.size(published); p != nil {
			api.packages = append(api.packages, p)
		}
	}
	sort.Slice(api.packages, func(i, j int) bool { return api.packages[i].dir < api.packages[j].dir })
	exporters := map[string][]string{}
	for _, p := range api.packages {
		if slices.Contains(kitPackages, p.dir) {
			continue
		}
		for _, name := range p.topLevel {
			exporters[name] = append(exporters[name], p.dir)
		}
	}
	for name, dirs := range exporters {
		if len(dirs) > 1 {
			api.shared[name] = dirs
		}
	}
	return api, nil
}

// source is a published package's parsed non-test files.
type source struct {
	dir        string // from the repository root, "." for the root
	importPath string
	name       string
	files      []*ast.File
	paths      []string // of files, in order
}

// readPackages parses the published packages: in the modules of
// scripts/release, not internal, not main.
func readPackages(root string) ([]*source, error) {
	modules, err := publishedModules(filepath.Join(root, "scripts", "release"))
	if err != nil {
		return nil, err
	}
	var sources []*source
	for _, module := range modules {
		modulePath, err := modulePath(filepath.Join(root, filepath.FromSlash(module), "go.mod"))
		if err != nil {
			return nil, err
		}
		dirs, err := packageDirs(root, module)
		if err != nil {
			return nil, err
		}
		for _, dir := range dirs {
			src, err := parseDir(root, dir)
			if err != nil {
				return nil, err
			}
			if src == nil || src.name == "main" {
				continue
			}
			rel, err := filepath.Rel(filepath.FromSlash(module), filepath.FromSlash(dir))
			if err != nil {
				return nil, err
			}
			src.importPath = path.Join(modulePath, filepath.ToSlash(rel))
			sources = append(sources, src)
		}
	}
	return sources, nil
}

var publishedLine = regexp.MustCompile(`^published=\(([^)]*)\)`)

// publishedModules reads the published=(...) line of scripts/release: the
// published modules' directories from the repository root.
func publishedModules(releaseScript string) ([]string, error) {
	b, err := os.ReadFile(releaseScript)
	if err != nil {
		return nil, err
	}
	for line := range strings.Lines(string(b)) {
		if m := publishedLine.FindStringSubmatch(line); m != nil {
			return strings.Fields(m[1]), nil
		}
	}
	return nil, fmt.Errorf("%s has no published=(...) line", releaseScript)
}

var moduleLine = regexp.MustCompile(`(?m)^module\s+"?([^"\s]+)"?\s*$`)

// modulePath reads the module path of a go.mod.
func modulePath(goMod string) (string, error) {
	b, err := os.ReadFile(goMod)
	if err != nil {
		return "", err
	}
	m := moduleLine.FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("%s has no module line", goMod)
	}
	return string(m[1]), nil
}

// packageDirs lists the directories, from root, of module's packages that
// may be published: not internal, not testdata, not in a nested module.
func packageDirs(root, module string) ([]string, error) {
	var dirs []string
	moduleDir := filepath.Join(root, filepath.FromSlash(module))
	err := filepath.WalkDir(moduleDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		if p != moduleDir {
			name := d.Name()
			if name == "internal" || name == "testdata" || name == "vendor" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
				return filepath.SkipDir
			}
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		dirs = append(dirs, filepath.ToSlash(rel))
		return nil
	})
	return dirs, err
}

// parseDir parses the non-test Go files of dir, or returns nil if it has
// none.
func parseDir(root, dir string) (*source, error) {
	dirPath := filepath.Join(root, filepath.FromSlash(dir))
	entries, err := os.ReadDir(dirPath)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	src := &source{dir: dir}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dirPath, name), nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		src.name = f.Name.Name
		src.files = append(src.files, f)
		src.paths = append(src.paths, filepath.Join(dirPath, name))
	}
	if len(src.files) == 0 {
		return nil, nil
	}
	return src, nil
}

// size counts what src exports, or returns nil if all its files are
// generated. published maps the published packages' import paths to their
// names.
func (src *source) size(published map[string]string) *pkgSize {
	p := &pkgSize{dir: src.dir}
	counted := false
	for _, f := range src.files {
		if ast.IsGenerated(f) {
			continue
		}
		counted = true
		imports := publishedImports(f, published)
		for _, decl := range f.Decls {
			p.add(decl, imports)
		}
	}
	if !counted {
		return nil
	}
	slices.Sort(p.topLevel)
	slices.Sort(p.reexported)
	return p
}

// publishedImports is the names f refers to published packages by.
func publishedImports(f *ast.File, published map[string]string) map[string]bool {
	names := map[string]bool{}
	for _, imp := range f.Imports {
		name, ok := published[strings.Trim(imp.Path.Value, "\"`")]
		if !ok {
			continue
		}
		if imp.Name != nil {
			name = imp.Name.Name
		}
		if name != "_" && name != "." {
			names[name] = true
		}
	}
	return names
}

// add counts decl's exported names. imports are the names its file refers
// to published packages by.
func (p *pkgSize) add(decl ast.Decl, imports map[string]bool) {
	switch d := decl.(type) {
	case *ast.FuncDecl:
		if !d.Name.IsExported() {
			return
		}
		if d.Recv != nil {
			if recv := receiverTypeName(d.Recv); token.IsExported(recv) {
				p.methods++
			}
			return
		}
		p.funcs++
		p.topLevel = append(p.topLevel, d.Name.Name)
		if funcReexports(d, imports) {
			p.reexported = append(p.reexported, d.Name.Name)
		}
	case *ast.GenDecl:
		for _, spec := range d.Specs {
			switch s := spec.(type) {
			case *ast.TypeSpec:
				if !s.Name.IsExported() {
					continue
				}
				p.types++
				p.topLevel = append(p.topLevel, s.Name.Name)
				if s.Assign.IsValid() && isPublishedName(unindex(s.Type), imports, nil) {
					p.reexported = append(p.reexported, s.Name.Name)
				}
			case *ast.ValueSpec:
				for i, n := range s.Names {
					if !n.IsExported() {
						continue
					}
					if d.Tok == token.CONST {
						p.consts++
					} else {
						p.vars++
					}
					p.topLevel = append(p.topLevel, n.Name)
					if len(s.Values) == len(s.Names) && valueReexports(s.Values[i], imports) {
						p.reexported = append(p.reexported, n.Name)
					}
				}
			}
		}
	}
}

// receiverTypeName is the name of the type a method is declared on.
func receiverTypeName(recv *ast.FieldList) string {
	if len(recv.List) != 1 {
		return ""
	}
	t := recv.List[0].Type
	if star, ok := t.(*ast.StarExpr); ok {
		t = star.X
	}
	if id, ok := unindex(t).(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// unindex strips type arguments: T[A] and T[A, B] become T.
func unindex(e ast.Expr) ast.Expr {
	switch x := e.(type) {
	case *ast.IndexExpr:
		return x.X
	case *ast.IndexListExpr:
		return x.X
	}
	return e
}

// isPublishedName says whether e is pkg.Y, pkg being one of imports and not
// one of the names shadowing them.
func isPublishedName(e ast.Expr, imports, shadowing map[string]bool) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	id, ok := sel.X.(*ast.Ident)
	return ok && imports[id.Name] && !shadowing[id.Name]
}

// valueReexports says whether a const's or var's value is pkg.Y or T(pkg.Y).
func valueReexports(v ast.Expr, imports map[string]bool) bool {
	if call, ok := v.(*ast.CallExpr); ok && len(call.Args) == 1 && !call.Ellipsis.IsValid() {
		v = call.Args[0]
	}
	return isPublishedName(v, imports, nil)
}

// funcReexports says whether f's body is one return of pkg.F(...), or of
// local(pkg.F(...)).
func funcReexports(f *ast.FuncDecl, imports map[string]bool) bool {
	if f.Body == nil || len(f.Body.List) != 1 {
		return false
	}
	ret, ok := f.Body.List[0].(*ast.ReturnStmt)
	if !ok || len(ret.Results) != 1 {
		return false
	}
	call, ok := ret.Results[0].(*ast.CallExpr)
	if !ok {
		return false
	}
	if _, ok := call.Fun.(*ast.Ident); ok && len(call.Args) == 1 {
		if call, ok = call.Args[0].(*ast.CallExpr); !ok {
			return false
		}
	}
	params := map[string]bool{}
	for _, list := range []*ast.FieldList{f.Type.TypeParams, f.Type.Params, f.Type.Results} {
		if list == nil {
			continue
		}
		for _, field := range list.List {
			for _, n := range field.Names {
				params[n.Name] = true
			}
		}
	}
	return isPublishedName(unindex(call.Fun), imports, params)
}
