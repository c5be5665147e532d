// Command chart draws the charts of BENCHMARKS.md as SVG from measured
// output only: the benchmarks' text (make bench's bin/bench.txt) and the
// load test's JSON (make load's bin/load.json). Nothing in a chart is typed
// by hand.
//
//	go run ./internal/chart [-bench bin/bench.txt] [-load bin/load.json] -out docs/bench
//
// From -bench: reserve-scale.svg (Reserve's median latency on tables of
// 10^4, 10^6 and 10^7 rows) and bench-ratios.svg (every interleaved ratio,
// median and range). From -load: load-throughput.svg (calls per second of
// each mode and mix against the bare server and pgbench) and load-cpu.svg
// (the CPU each call costs, split between the server, the load tool,
// PostgreSQL and the rest of the machine).
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/idemkey/idemkey/tests/benchfile"
)

func main() {
	bench := flag.String("bench", "", "the output of go test -bench (make bench's bin/bench.txt)")
	load := flag.String("load", "", "the JSON that internal/load writes with -json (make load's bin/load.json)")
	out := flag.String("out", "docs/bench", "the directory the charts go to")
	flag.StringVar(&format, "format", "svg", "the charts' format: svg, png or pdf")
	flag.Parse()
	if err := run(*bench, *load, *out); err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

// format is the charts' file format, and their files' extension.
var format = "svg"

// save writes p to dir/name.format, in small type, with room on the right
// of horizontal bars for the legend.
func save(p *plot.Plot, w, h vg.Length, dir, name string) error {
	p.Title.TextStyle.Font.Size = vg.Points(11)
	p.Legend.TextStyle.Font.Size = vg.Points(9)
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font.Size = vg.Points(10)
		a.Tick.Label.Font.Size = vg.Points(8)
	}
	if p.Legend.Top && p.X.Min == 0 {
		p.X.Max *= 1.4
	}
	return p.Save(w, h, filepath.Join(dir, name+"."+format))
}

func run(benchPath, loadPath, out string) error {
	if benchPath == "" && loadPath == "" {
		return errors.New("nothing to draw: give -bench, -load or both")
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if benchPath != "" {
		f, err := os.Open(benchPath)
		if err != nil {
			return err
		}
		metrics, err := benchfile.Parse(f)
		f.Close()
		if err != nil {
			return err
		}
		if err := reserveScale(metrics, out, "reserve-scale"); err != nil {
			return err
		}
		if err := benchRatios(metrics, out, "bench-ratios"); err != nil {
			return err
		}
	}
	if loadPath != "" {
		data, err := os.ReadFile(loadPath)
		if err != nil {
			return err
		}
		var res loadResults
		if err := json.Unmarshal(data, &res); err != nil {
			return fmt.Errorf("%s: %w", loadPath, err)
		}
		if err := loadThroughput(res, out, "load-throughput"); err != nil {
			return err
		}
		if err := loadCPU(res, out, "load-cpu"); err != nil {
			return err
		}
	}
	return nil
}

// palette is a few colours that stay apart in print and for most colour
// blindness (Okabe and Ito's).
var palette = []color.Color{
	color.RGBA{0, 114, 178, 255},   // blue
	color.RGBA{230, 159, 0, 255},   // orange
	color.RGBA{0, 158, 115, 255},   // green
	color.RGBA{204, 121, 167, 255}, // purple
	color.RGBA{86, 180, 233, 255},  // sky
	color.RGBA{213, 94, 0, 255},    // vermilion
}

// reserveScale draws Reserve's median latency by table size, one group of
// bars per kind of call; each bar is the median of the runs' medians.
func reserveScale(metrics []*benchfile.Metric, dir, name string) error {
	kinds := []struct{ unit, label string }{
		{"insert", "insert (new key)"},
		{"replay", "replay, random key"},
		{"replay-recent", "replay, recent key"},
	}
	sizes := []struct{ unit, label string }{{"1e4", "10^4 rows"}, {"1e6", "10^6 rows"}, {"1e7", "10^7 rows"}}
	p := plot.New()
	p.Title.Text = "Reserve's median latency by table size (µs)"
	p.Y.Label.Text = "µs, median of the runs"
	p.Y.Min = 0
	w := vg.Points(18)
	found := false
	for i, size := range sizes {
		var vals plotter.Values
		for _, kind := range kinds {
			m := benchfile.Find(metrics, "ReserveScale", kind.unit+"-p50-ns@"+size.unit)
			if m == nil {
				vals = append(vals, 0)
				continue
			}
			found = true
			vals = append(vals, benchfile.Median(m.Values)/1e3)
		}
		bars, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return err
		}
		bars.Color, bars.LineStyle.Width = palette[i], 0
		bars.Offset = w * vg.Length(i-1)
		p.Add(bars)
		p.Legend.Add(size.label, bars)
	}
	if !found {
		return errors.New("the benchmarks' output has no ReserveScale results")
	}
	var names []string
	for _, k := range kinds {
		names = append(names, k.label)
	}
	p.NominalX(names...)
	p.Legend.Top = true
	p.Y.Max *= 1.15 // room for the legend
	p.Add(plotter.NewGrid())
	return save(p, 16*vg.Centimeter, 10*vg.Centimeter, dir, name)
}

// benchRatios draws every interleaved ratio of the run: a bar at its median
// and a line over its range.
func benchRatios(metrics []*benchfile.Metric, dir, name string) error {
	var (
		names    []string
		medians  plotter.Values
		extremes plotter.XErrors
		points   plotter.XYs
	)
	for _, m := range slices.Backward(metrics) { // NominalY counts from the bottom
		if !benchfile.IsRatio(m.Unit) {
			continue
		}
		med := benchfile.Median(m.Values)
		names = append(names, m.Bench+": "+m.Unit)
		medians = append(medians, med)
		extremes = append(extremes, struct{ Low, High float64 }{med - slices.Min(m.Values), slices.Max(m.Values) - med})
		points = append(points, plotter.XY{X: med, Y: float64(len(points))})
	}
	if len(names) == 0 {
		return errors.New("the benchmarks' output has no ratios")
	}
	p := plot.New()
	p.Title.Text = "Every interleaved ratio of one make bench run: median, and range over the runs"
	p.X.Label.Text = "ratio (1 = the same cost as its baseline)"
	bars, err := plotter.NewBarChart(medians, vg.Points(9))
	if err != nil {
		return err
	}
	bars.Horizontal, bars.Color, bars.LineStyle.Width = true, palette[0], 0
	p.Add(bars)
	errs := &struct {
		plotter.XYs
		plotter.XErrors
	}{points, extremes}
	ranges, err := plotter.NewXErrorBars(errs)
	if err != nil {
		return err
	}
	p.Add(ranges, refLine(1, len(names)))
	p.NominalY(names...)
	p.X.Min = 0
	p.Add(plotter.NewGrid())
	return save(p, 18*vg.Centimeter, vg.Length(len(names))*0.45*vg.Centimeter+3*vg.Centimeter, dir, name)
}

// refLine is a dashed vertical line at x over n horizontal bars.
func refLine(x float64, n int) *plotter.Line {
	l, _ := plotter.NewLine(plotter.XYs{{X: x, Y: -0.5}, {X: x, Y: float64(n) - 0.5}})
	l.Color, l.Dashes = color.Gray{Y: 90}, []vg.Length{vg.Points(3), vg.Points(2)}
	return l
}

// loadResults is the part of internal/load's JSON the charts draw.
type loadResults struct {
	Date        string `json:"date"`
	CPUs        int    `json:"cpus"`
	Clients     int    `json:"clients"`
	Rounds      int    `json:"rounds"`
	RunDuration string `json:"run_duration"`
	Rows        []struct {
		Mode      string  `json:"mode"`
		Mix       string  `json:"mix"`
		PerSecond float64 `json:"per_second"`
		Server    float64 `json:"cpu_server_us"`
		Load      float64 `json:"cpu_load_us"`
		Postgres  float64 `json:"cpu_postgres_us"`
		Rest      float64 `json:"cpu_rest_us"`
	} `json:"rows"`
}

var mixLabels = map[string]string{
	"new": "new keys", "pgbench": "pgbench, minimal SQL", "replay": "replay",
	"retry": "replay as a retry", "storm": "storm, 62 keys",
}

// labels names the rows, the first at the top.
func (res loadResults) labels() []string {
	var names []string
	for _, r := range res.Rows {
		names = append(names, r.Mode+": "+mixLabels[r.Mix])
	}
	slices.Reverse(names) // NominalY counts from the bottom
	return names
}

func (res loadResults) subtitle() string {
	return fmt.Sprintf("%d clients, %d rounds of %s interleaved, %d CPUs shared by all", res.Clients, res.Rounds, res.RunDuration, res.CPUs)
}

// loadThroughput draws the calls per second of each row, coloured by kind
// (the bare server, autocommitted and in a transaction; idemkey; pgbench),
// with a line at the autocommitted bare server's.
func loadThroughput(res loadResults, dir, name string) error {
	if len(res.Rows) == 0 {
		return errors.New("the load results have no rows")
	}
	p := plot.New()
	p.Title.Text = "make load: calls per second against the bare server\n" + res.subtitle()
	p.X.Label.Text = "calls (pgbench: transactions) per second"
	n := len(res.Rows)
	kinds := []struct {
		label string
		match func(mode, mix string) bool
	}{
		{"bare server", func(mode, _ string) bool { return strings.HasPrefix(mode, "bare") }}, // bare and bare-tx
		{"idemkey", func(mode, mix string) bool { return !strings.HasPrefix(mode, "bare") && mix != "pgbench" }},
		{"pgbench ceiling", func(_, mix string) bool { return mix == "pgbench" }},
	}
	bare := 0.0
	for k, kind := range kinds {
		vals := make(plotter.Values, n)
		for i, r := range res.Rows {
			if kind.match(r.Mode, r.Mix) {
				vals[n-1-i] = r.PerSecond
			}
			if r.Mode == "bare" && r.Mix == "new" {
				bare = r.PerSecond
			}
		}
		bars, err := plotter.NewBarChart(vals, vg.Points(11))
		if err != nil {
			return err
		}
		bars.Horizontal, bars.Color, bars.LineStyle.Width = true, palette[k], 0
		p.Add(bars)
		p.Legend.Add(kind.label, bars)
	}
	if bare > 0 {
		p.Add(refLine(bare, n))
	}
	p.NominalY(res.labels()...)
	p.X.Min = 0
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	return save(p, 18*vg.Centimeter, vg.Length(n)*0.6*vg.Centimeter+4*vg.Centimeter, dir, name)
}

// loadCPU draws each row's CPU per call, stacked: the server, the load tool,
// PostgreSQL and the rest of the machine.
func loadCPU(res loadResults, dir, name string) error {
	if len(res.Rows) == 0 {
		return errors.New("the load results have no rows")
	}
	p := plot.New()
	p.Title.Text = "make load: CPU per call, over all CPUs (µs)\n" + res.subtitle()
	p.X.Label.Text = "µs of CPU per call (pgbench: per transaction)"
	n := len(res.Rows)
	parts := []struct {
		label string
		value func(i int) float64
	}{
		{"server", func(i int) float64 { return res.Rows[i].Server }},
		{"load tool (ghz, pgbench)", func(i int) float64 { return res.Rows[i].Load }},
		{"PostgreSQL", func(i int) float64 { return res.Rows[i].Postgres }},
		{"rest of the machine", func(i int) float64 { return max(res.Rows[i].Rest, 0) }},
	}
	var below *plotter.BarChart
	for k, part := range parts {
		vals := make(plotter.Values, n)
		for i := range res.Rows {
			vals[n-1-i] = part.value(i)
		}
		bars, err := plotter.NewBarChart(vals, vg.Points(11))
		if err != nil {
			return err
		}
		bars.Horizontal, bars.Color, bars.LineStyle.Width = true, palette[k], 0
		if below != nil {
			bars.StackOn(below)
		}
		below = bars
		p.Add(bars)
		p.Legend.Add(part.label, bars)
	}
	p.NominalY(res.labels()...)
	p.X.Min = 0
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	return save(p, 18*vg.Centimeter, vg.Length(n)*0.6*vg.Centimeter+4*vg.Centimeter, dir, name)
}
