package idemkey

import (
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// dateLayout is RFC 9110's IMF-fixdate.
const dateLayout = "Mon, 02 Jan 2006 15:04:05 GMT"

// FormatDate returns t, truncated to the second, as an HTTP date
// (IMF-fixdate), such as "Tue, 01 Dec 2026 20:05:37 GMT".
func FormatDate(t time.Time) string {
	unix := t.Unix()
	written := &writtenDates[uint64(unix)%uint64(len(writtenDates))]
	if w := written.Load(); w != nil && w.unix == unix {
		return w.text
	}
	t = t.UTC()
	year, month, day := t.Date()
	if year < 0 || year > 9999 {
		return t.Format(dateLayout) // its own way with years of other than four digits
	}
	// t.Format(dateLayout) without reading the layout: every answer tells it.
	hour, minute, sec := t.Clock()
	b := make([]byte, 0, len(dateLayout))
	b = append(b, t.Weekday().String()[:3]...)
	b = append(b, ", "...)
	b = appendDigits(b, day, 2)
	b = append(b, ' ')
	b = append(b, month.String()[:3]...)
	b = append(b, ' ')
	b = appendDigits(b, year, 4)
	b = append(b, ' ')
	b = appendDigits(b, hour, 2)
	b = append(b, ':')
	b = appendDigits(b, minute, 2)
	b = append(b, ':')
	b = appendDigits(b, sec, 2)
	b = append(b, " GMT"...)
	text := string(b)
	written.Store(&writtenDate{unix: unix, text: text})
	return text
}

// writtenDates caches FormatDate's last dates by second: a key's expiry is
// the same for its retries and for the other first calls of its second.
var writtenDates [64]atomic.Pointer[writtenDate]

type writtenDate struct {
	unix int64
	text string
}

// appendDigits appends n >= 0 in width decimal digits.
func appendDigits(b []byte, n, width int) []byte {
	var d [4]byte
	for i := width - 1; i >= 0; i-- {
		d[i] = byte('0' + n%10)
		n /= 10
	}
	return append(b, d[:width]...)
}

// ErrDate is ParseDate's error.
var ErrDate = errors.New("idemkey: not an HTTP date (such as \"Tue, 01 Dec 2026 20:05:37 GMT\")")

// ParseDate reads an HTTP date in any of the three forms RFC 9110, section
// 5.6.7, has a recipient accept (IMF-fixdate, RFC 850, asctime), each to the
// letter; as in net/http, the day name is not checked against the date.
func ParseDate(v string) (time.Time, error) {
	for i := range dateForms {
		if t, ok := dateForms[i].parse(v); ok {
			return t, nil
		}
	}
	return time.Time{}, ErrDate
}

// dateForm is one form of an HTTP date: a day name, sep, then layout.
type dateForm struct {
	days    []string
	sep     string
	layout  string
	century bool // a two-digit year (RFC 850)
}

var (
	shortDays = []string{"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"}
	longDays  = []string{"Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"}
	// asctime's day of the month is two digits or a space and one: a layout each.
	dateForms = []dateForm{
		{shortDays, ", ", dateLayout[len("Mon, "):], false},
		{longDays, ", ", "02-Jan-06 15:04:05 GMT", true},
		{shortDays, " ", "Jan _2 15:04:05 2006", false},
		{shortDays, " ", "Jan 02 15:04:05 2006", false},
	}
)

// parse reads v in form f. time.Parse alone would take other case,
// one-digit hours or fractions of a second: what it read must format back.
func (f *dateForm) parse(v string) (t time.Time, ok bool) {
	day, rest, ok := strings.Cut(v, f.sep)
	if !ok || !slices.Contains(f.days, day) {
		return time.Time{}, false
	}
	t, err := time.Parse(f.layout, rest)
	if err != nil || t.Format(f.layout) != rest {
		return time.Time{}, false
	}
	if f.century {
		return nearestCentury(t, time.Now())
	}
	return t, true
}

// nearestCentury puts t's two-digit year in the century that makes it at
// most 50 years after now (RFC 9110, section 5.6.7). ok is false if the day
// does not exist that year (29 February of 1900).
func nearestCentury(t, now time.Time) (time.Time, bool) {
	now = now.UTC()
	year := now.Year() - now.Year()%100 + t.Year()%100
	in := func(year int) time.Time {
		return time.Date(year, t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), 0, time.UTC)
	}
	limit := now.AddDate(50, 0, 0)
	switch {
	case in(year).After(limit):
		year -= 100
	case !in(year + 100).After(limit):
		year += 100
	}
	u := in(year)
	return u, u.Day() == t.Day()
}

// ParseExpires reads the key's expiry from an ExpiresHeader or
// ExpiresMetadata field's values; ok is false unless there is exactly one,
// an HTTP date. Over gRPC, interceptor.KeyExpiry reads it too.
func ParseExpires(values []string) (t time.Time, ok bool) {
	if len(values) != 1 {
		return time.Time{}, false
	}
	t, err := ParseDate(values[0])
	return t, err == nil
}
